"""The one `torch.compile`: capture of the forwards (`capture`), regional compilation
(`regions`), compile workers (`workers`), the opaque-op list (`boundaries`), inductor settings
(`inductor`), flat graph calls (`flat_call`) and the compile cache (`cache`)."""
