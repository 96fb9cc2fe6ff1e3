"""ember's linears and embeddings: the kernels' weight layouts (`panels`), dense and per-channel
layers (`packed`), group-quantized layers (`group`), and the rewrites that install them in an HF
model (`rewrite`)."""
