// Packing group-quantized weights into their panels (codes, or GGUF blocks).
// One part of ember_cpu.cpp's translation unit (included there, in order; not built alone).
#pragma once

namespace {

// ---------------------------------------------------------------------------------------------
// Loading group-quantized weights (`GroupLinear`): rows of codes, or of GGUF blocks straight
// from the file, written into the panels in one pass (the torch re-layout took ~6 ops per
// chunk of rows: qwen2-0.5b Q4_0 loaded in 3.3 s against llama.cpp's 0.6 s).

// Writes channel `row`'s stored bytes (the `GroupLinear` layout before panels, `Q` 32-bit
// lanes) into panel lanes: lane j of channel n goes to codes[n / P][j][n % P].
inline void scatter_lanes(uint8_t* codes, int64_t Q, int64_t P, int64_t row,
                          const uint8_t* stored) {
  uint32_t* panel = reinterpret_cast<uint32_t*>(codes) + (row / P) * Q * P + row % P;
  for (int64_t j = 0; j < Q; ++j) std::memcpy(panel + j * P, stored + 4 * j, 4);
}

// Channel `row`'s plain groups (see plain_head_rows) into its panel of codes [panels, Q, P, 4]:
// group g's head, rows of fp16 holding d[g] (6-bit: d[2g], d[2g + 1]; with offsets, then
// m[g]), then its stored code bytes (`stored`, plain_group_bytes less the head's a group) as
// lanes.
inline void scatter_plain(uint8_t* codes, int64_t Q, int64_t P, int64_t row, int64_t G,
                          int64_t bits, bool min, const uint8_t* stored, const uint16_t* d,
                          const uint16_t* m) {
  const int64_t rows = plain_head_rows(bits, min), group = plain_group_bytes(bits, min) * P;
  const int64_t code_lanes = kGroup * bits / 32, c = row % P;
  uint8_t* panel = codes + (row / P) * Q * 4 * P;
  for (int64_t g = 0; g < G; ++g) {
    uint8_t* head = panel + g * group;
    for (int64_t h = 0; h < rows; ++h) {
      const uint16_t v = h == 0 || bits == 6 ? d[g * (bits == 6 ? 2 : 1) + h] : m[g];
      std::memcpy(head + 2 * (h * P + c), &v, 2);
    }
    uint8_t* lanes = head + 2 * rows * P;
    for (int64_t j = 0; j < code_lanes; ++j)
      std::memcpy(lanes + 4 * (j * P + c), stored + 4 * (g * code_lanes + j), 4);
  }
}

// A group's 32 4-bit codes `q` (one per byte, low nibbles read) as 16 stored bytes: byte
// 4i + j holds k = 8i + j in its low nibble and 8i + 4 + j in its high one.
inline void store_nibbles(const uint8_t* q, uint8_t* out) {
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j)
      out[4 * i + j] = (q[8 * i + j] & 15) | (q[8 * i + 4 + j] & 15) << 4;
}

// A group's 32 5-bit codes' high bits (bit 4 of each q) as 4 stored bytes, in the order of
// its nibble bytes: byte t holds k = 8i + t in bit 2i and k = 8i + 4 + t in bit 2i + 1.
inline void store_high_bits(const uint8_t* q, uint8_t* out) {
  for (int t = 0; t < 4; ++t) {
    uint8_t b = 0;
    for (int i = 0; i < 4; ++i) {
      b |= ((q[8 * i + t] >> 4) & 1) << (2 * i);
      b |= ((q[8 * i + 4 + t] >> 4) & 1) << (2 * i + 1);
    }
    out[t] = b;
  }
}

// A 5-bit group's 20 stored bytes from its 32 codes: the high bits, then the nibbles, the
// order the kernel reads them in (see group_rows).
inline void store_five_bit_group(const uint8_t* q, uint8_t* out) {
  store_high_bits(q, out);
  store_nibbles(q, out + 4);
}

// A 6-bit group's 24 stored bytes from its 16 nibble bytes and the 4 pair bytes of each
// half h (k = 16h + 4c + j in bits 2c of byte j): per half, its pair bytes, then its 8 nibble
// bytes (lanes 2h and 2h + 1), the order the kernel reads them in (see group_rows).
inline void store_six_bit_group(const uint8_t* nibbles, const uint8_t* pairs, uint8_t* out) {
  for (int h = 0; h < 2; ++h) {
    std::memcpy(out + 12 * h, pairs + 4 * h, 4);
    std::memcpy(out + 12 * h + 4, nibbles + 8 * h, 8);
  }
}

// One channel's stored bytes from its codes (one per value: int8 q for 8 bits, uint8 for 4,
// 5 and 6; see `GroupLinear`).
void store_codes(const uint8_t* q, int64_t K, int64_t bits, uint8_t* out) {
  if (bits == 8) {
    for (int64_t k = 0; k < K; ++k) out[k] = q[k] ^ 0x80;  // int8 q + 128
    return;
  }
  const int64_t step = bits == 4 ? 16 : bits == 5 ? 20 : 24;  // stored bytes per group of 32
  for (int64_t g = 0; g < K / 32; ++g, q += 32, out += step) {
    if (bits == 4) store_nibbles(q, out);
    if (bits == 5) store_five_bit_group(q, out);
    if (bits == 6) {  // the high pairs of each 16 k: k = 16h + 4c + j in bits 2c of byte j
      uint8_t nibbles[16], pairs[8];
      store_nibbles(q, nibbles);
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j) {
          uint8_t b = 0;
          for (int c = 0; c < 4; ++c) b |= ((q[16 * h + 4 * c + j] >> 4) & 3) << (2 * c);
          pairs[4 * h + j] = b;
        }
      store_six_bit_group(nibbles, pairs, out);
    }
  }
}

// GGUF block types `group_pack_blocks` reads: name, values per block, bytes per block, code
// bits of the panels they fill, whether those carry offsets, whether they are laid out in
// super-blocks of 256 (see linear_group.h), and the decoder in store_blocks (kPlain: an fp16
// scale, an fp16 offset where `offsets`, then the codes: Q8_0, Q4_0, Q4_1).
// The table of which types are packed how is mirrored by ember.model.layers.BLOCK_TYPES;
// each call checks its panels against this one.
enum class BlockDecoder { kPlain, kQ4K, kQ6K, kQ5_0 };
struct BlockType {
  const char* name;
  int64_t values, bytes, bits;
  bool offsets, super_blocks;
  BlockDecoder decoder;
};
constexpr BlockType kBlockTypes[] = {
    {"Q8_0", 32, 34, 8, false, false, BlockDecoder::kPlain},
    {"Q4_0", 32, 18, 4, false, false, BlockDecoder::kPlain},
    {"Q4_1", 32, 20, 4, true, false, BlockDecoder::kPlain},
    {"Q4_K", 256, 144, 4, true, true, BlockDecoder::kQ4K},
    {"Q6_K", 256, 210, 6, false, true, BlockDecoder::kQ6K},
    {"Q5_0", 32, 22, 5, false, false, BlockDecoder::kQ5_0},
};

// One group's 16 stored nibble bytes (byte 4i + j = q[8i + j] | q[8i + 4 + j] << 4, as
// store_nibbles) from 32 bytes holding its codes q_t in bits shift .. shift + 3 of byte t
// (Q4_K's and Q6_K's low nibbles): 32-bit word operations, no byte loop.
inline void nibble_group(const uint8_t* src, int shift, uint8_t* out) {
  constexpr uint32_t lo = 0x0F0F0F0Fu;
  uint32_t w[8], s[4];
  std::memcpy(w, src, 32);
  for (int i = 0; i < 4; ++i) s[i] = (w[2 * i] >> shift & lo) | (w[2 * i + 1] >> shift & lo) << 4;
  std::memcpy(out, s, 16);
}

// One channel's stored bytes, fp16 scales d[g * P] (and offsets m[g * P]; P a stride: the
// panel width for super-blocks' rows of d, 1 for plain groups' heads) from its blocks:
// Q8_0 (fp16 d, 32 int8 q), Q4_0 (fp16 d, 16 bytes: q_t in the low nibble of byte t, q_16+t
// in its high one), Q4_1 (fp16 d and m, then as Q4_0) exactly; Q4_K (fp16 d and dmin, 12
// bytes of 6-bit sc and m per 32 values, 128 bytes of nibbles: sub-blocks 2i and 2i + 1 in
// the low and high nibbles of bytes 32i..32i + 31) and Q6_K (128 bytes of low nibbles, 64 of
// high pairs, 16 int8 sc, fp16 d) exactly, in super-blocks (d[s * P], m[s * P] per
// super-block s; Q6_K's codes q in [0, 63] in ggml's dequantizers' order); Q5_0 (fp16 d,
// 32 high bits, 16 bytes of low nibbles as Q4_0's) exactly, as 5-bit codes q in [0, 31]
// (value d (q - 16)): 4 bytes of high bits, then Q4_0's nibbles (store_five_bit_group).
void store_blocks(const uint8_t* blocks, int64_t K, const BlockType& type, uint8_t* out,
                  uint16_t* d, uint16_t* m, int64_t P) {
  for (int64_t blk = 0; blk < K / type.values; ++blk) {
    const uint8_t* b = blocks + blk * type.bytes;
    if (type.decoder == BlockDecoder::kQ4K) {
      // Super-block blk: d, dm = -dmin (the sign bit flipped: exact), then per channel the 8
      // scales sc and the 8 offsets m as bytes (ggml's get_scale_min_k4), then the 8 groups'
      // 16 nibble bytes: 144 bytes.
      d[blk * P] = static_cast<uint16_t>(b[0] | b[1] << 8);
      m[blk * P] = static_cast<uint16_t>((b[2] | b[3] << 8) ^ 0x8000);
      const uint8_t* sm = b + 4;
      uint8_t* o = out + blk * 144;
      for (int j = 0; j < 8; ++j) {
        o[j] = j < 4 ? sm[j] & 63 : (sm[j + 4] & 15) | (sm[j - 4] >> 6) << 4;
        o[8 + j] = j < 4 ? sm[j + 4] & 63 : (sm[j + 4] >> 4) | (sm[j] >> 6) << 4;
      }
      for (int g = 0; g < 8; ++g)  // sub-block g: the low (even g) or high nibbles
        nibble_group(b + 16 + 32 * (g / 2), 4 * (g % 2), o + 16 + 16 * g);
      continue;
    }
    if (type.decoder == BlockDecoder::kQ6K) {
      // Value 128 h + 32 s + t (s, t < 32 in each half h): its low nibble in bits 4 (s / 2)
      // of ql[64 h + 32 (s % 2) + t], its high pair in bits 2 s of qh[32 h + t]. That is
      // group 4 h + s: nibbles as nibble_group's; pair bytes 4 c + j of each 16 k, four a
      // stored byte (k = 16 u + 4 c + j in bits 2c of byte 4 u + j), from 32-bit words.
      // Super-block blk: d, then per channel the 16 int8 scales and the 8 groups' 24 bytes
      // (208 bytes).
      const uint8_t *ql = b, *qh = b + 128;
      d[blk * P] = static_cast<uint16_t>(b[208] | b[209] << 8);
      std::memcpy(out + blk * 208, b + 192, 16);
      for (int g = 0; g < 8; ++g) {
        const int h = g / 4, s = g % 4;
        uint8_t nibbles[16];
        nibble_group(ql + 64 * h + 32 * (s % 2), 4 * (s / 2), nibbles);
        uint32_t w[8], pairs[2] = {0, 0};
        std::memcpy(w, qh + 32 * h, 32);
        for (int u = 0; u < 2; ++u)
          for (int c = 0; c < 4; ++c)
            pairs[u] |= (w[4 * u + c] >> (2 * s) & 0x03030303u) << (2 * c);
        store_six_bit_group(nibbles, reinterpret_cast<const uint8_t*>(pairs),
                            out + blk * 208 + 16 + 24 * g);
      }
      continue;
    }
    if (type.decoder == BlockDecoder::kQ5_0) {
      std::memcpy(d + blk * P, b, 2);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      uint8_t q[32];
      for (int t = 0; t < 32; ++t) {
        const int low = t < 16 ? b[6 + t] & 15 : b[6 + t - 16] >> 4;
        q[t] = static_cast<uint8_t>(low | (qh >> t & 1) << 4);
      }
      store_five_bit_group(q, out + 20 * blk);
      continue;
    }
    const int64_t head = type.offsets ? 4 : 2;
    std::memcpy(d + blk * P, b, 2);
    if (type.offsets) std::memcpy(m + blk * P, b + 2, 2);
    const uint8_t* c = b + head;
    if (type.bits == 8) {
      for (int k = 0; k < 32; ++k) out[32 * blk + k] = c[k] ^ 0x80;
      continue;
    }
    // stored byte 4i + j = q[8i + j] | q[8i + 4 + j] << 4, q_t = c[t] & 15, q_16+t = c[t] >> 4
    uint32_t w[4];
    std::memcpy(w, c, 16);
    const uint32_t lo = 0x0F0F0F0Fu;
    const uint32_t s[4] = {(w[0] & lo) | (w[1] & lo) << 4, (w[2] & lo) | (w[3] & lo) << 4,
                           (w[0] >> 4 & lo) | (w[1] & ~lo), (w[2] >> 4 & lo) | (w[3] & ~lo)};
    std::memcpy(out + 16 * blk, s, 16);
  }
}

void check_group_panels(const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t row, int64_t n,
                        int64_t bits, const char* op) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, op,
              ": bits must be 4, 5, 6 or 8");
  TORCH_CHECK(codes.dim() == 4 && codes.size(3) == 4 && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous(),
              op, ": codes must be contiguous uint8 panels [P, lanes, panel, 4]");
  const int64_t P = codes.size(2);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(2) == P &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              op, ": scales must be contiguous fp16 [P, super-blocks (plain groups: 0), panel]");
  TORCH_CHECK(!mins || (mins->sizes() == scales.sizes() && mins->scalar_type() == at::kHalf &&
                        mins->is_contiguous()),
              op, ": mins must be shaped as scales");
  TORCH_CHECK(row >= 0 && row % P == 0 && row + n <= codes.size(0) * P, op, ": rows [", row,
              ", ", row + n, ") do not start a panel or do not fit the panels");
}

// Rows [row, row + n) of a `GroupLinear`'s plain panels (see plain_head_rows) from codes q
// [n, K] (int8 for 8 bits, else uint8), fp16 scales d [n, K / 32] (6 bits: [n, K / 16]) and
// offsets m (4 bits); the panels' `scales` (and `mins`) are empty [P, 0, panel].
void group_pack_codes(at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                      int64_t row, const at::Tensor& q_in, const at::Tensor& d_in,
                      const c10::optional<at::Tensor>& m_in, int64_t bits) {
  const char* op = "group_pack_codes";
  TORCH_CHECK(q_in.dim() == 2, op, ": codes must be 2-D [n, K]");
  const int64_t n = q_in.size(0), K = q_in.size(1);
  check_group_panels(codes, scales, mins, row, n, bits, op);
  TORCH_CHECK(q_in.scalar_type() == (bits == 8 ? at::kChar : at::kByte), op,
              ": codes must be int8 for 8 bits, uint8 for 4, 5 and 6");
  const int64_t Q = codes.size(1), P = codes.size(2), per = bits == 6 ? 16 : 32;
  const bool min = mins.has_value();
  TORCH_CHECK(K % 32 == 0 && K > 0 && Q == plain_lanes(K / 32, bits, min) &&
                  scales.size(1) == 0,
              op, ": codes [", n, ", ", K, "] do not match the panels");
  TORCH_CHECK(d_in.sizes() == at::IntArrayRef({n, K / per}) && d_in.scalar_type() == at::kHalf,
              op, ": scales must be fp16 [n, K / ", per, "]");
  TORCH_CHECK(min == m_in.has_value() &&
                  (!m_in || (m_in->sizes() == d_in.sizes() && m_in->scalar_type() == at::kHalf)),
              op, ": offsets must be given for offset panels only, shaped as scales");
  const at::Tensor q = q_in.contiguous(), d = d_in.contiguous();
  const at::Tensor m = m_in ? m_in->contiguous() : at::Tensor();
  const auto* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = m.defined() ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr;
  auto* cp = codes.data_ptr<uint8_t>();
  const int64_t G = K / 32, D = K / per, panels = (n + P - 1) / P;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> stored(K * bits / 8);
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = p * P; r < std::min(n, (p + 1) * P); ++r) {
        store_codes(qp + r * K, K, bits, stored.data());
        scatter_plain(cp, Q, P, row + r, G, bits, min, stored.data(), dp + r * D,
                      mp ? mp + r * G : nullptr);
      }
  });
}

// Rows [row, row + n) of a `GroupLinear`'s panels straight from a GGUF tensor's bytes
// `blocks` [n, row bytes] of `type` (see `kBlockTypes` and `store_blocks`): super-blocks, or
// plain groups with their scales in their heads (scatter_plain).
void group_pack_blocks(at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                       int64_t row, const at::Tensor& blocks_in, c10::string_view type_name) {
  const char* op = "group_pack_blocks";
  const BlockType* type = nullptr;
  for (const BlockType& t : kBlockTypes)
    if (type_name == t.name) type = &t;
  TORCH_CHECK(type != nullptr, op, ": unknown block type ", type_name);
  TORCH_CHECK(blocks_in.dim() == 2 && blocks_in.scalar_type() == at::kByte, op,
              ": blocks must be uint8 [n, row bytes]");
  const int64_t n = blocks_in.size(0);
  check_group_panels(codes, scales, mins, row, n, type->bits, op);
  TORCH_CHECK(mins.has_value() == type->offsets, op, ": ", type->name, " panels ",
              type->offsets ? "need" : "have no", " offsets");
  const int64_t Q = codes.size(1), P = codes.size(2), row_bytes = blocks_in.size(1);
  const int64_t K = row_bytes / type->bytes * type->values, G = K / kGroup;
  // super-blocks: d (and dm) per 256 k in `scales` (`mins`); plain groups: in their heads
  const bool fits =
      type->super_blocks
          ? scales.size(1) == K / 256 && Q * 4 == K / 256 * (type->bits == 6 ? 208 : 144)
          : scales.size(1) == 0 && Q == plain_lanes(G, type->bits, type->offsets);
  TORCH_CHECK(K > 0 && row_bytes % type->bytes == 0 && fits, op, ": rows of ", row_bytes,
              " bytes are not whole ", type->name, " blocks of ", type->bytes,
              " bytes filling these panels");
  const at::Tensor blocks = blocks_in.contiguous();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  auto* cp = codes.data_ptr<uint8_t>();
  auto* sp = reinterpret_cast<uint16_t*>(scales.data_ptr());
  auto* mp = mins ? reinterpret_cast<uint16_t*>(mins->data_ptr()) : nullptr;
  const int64_t first = row / P, panels = (n + P - 1) / P, S = K / 256;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> stored(type->super_blocks ? Q * 4 : K * type->bits / 8);
    std::vector<uint16_t> d(type->super_blocks ? 0 : G), m(d.size());  // plain groups' d, m
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = p * P; r < std::min(n, (p + 1) * P); ++r) {
        const uint8_t* src = bp + r * row_bytes;
        if (type->super_blocks) {
          const int64_t base = (first + p) * S * P + r % P;
          store_blocks(src, K, *type, stored.data(), sp + base, mp ? mp + base : nullptr, P);
          scatter_lanes(cp, Q, P, row + r, stored.data());
        } else {
          store_blocks(src, K, *type, stored.data(), d.data(), m.data(), 1);
          scatter_plain(cp, Q, P, row + r, G, type->bits, type->offsets, stored.data(),
                        d.data(), m.data());
        }
      }
  });
}

}  // namespace
