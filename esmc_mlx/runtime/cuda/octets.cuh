// Decoding packed weights, eight values (an octet) at a time, as MLX's CUDA dequantize computes
// them (affine_quantize.cu, fp_quantize.cuh): the header of dequantize.cu's and qmm.cu's kernels.

// The 8 values of one octet: BITS bytes of the little-endian bit stream, one aligned load
// when the address allows (BITS = 2, 4, 8), else byte loads.
template <int B>
__device__ __forceinline__ uint64_t load_octet(const uint8_t* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if constexpr (B == 8) {
    if ((a & 7) == 0) {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      return uint64_t(v.x) | (uint64_t(v.y) << 32);
    }
  } else if constexpr (B == 4) {
    if ((a & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (B == 2) {
    if ((a & 1) == 0) return *reinterpret_cast<const uint16_t*>(p);
  }
  uint64_t v = 0;
#pragma unroll
  for (int k = 0; k < B; ++k) v |= uint64_t(p[k]) << (8 * k);
  return v;
}

__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint32_t bits16(__half x) { return __half_as_ushort(x); }

// Store 8 outputs with 128-bit stores, from registers (out is a fresh, aligned buffer and
// every octet starts at a multiple of 8 values).
template <typename O>
__device__ __forceinline__ void store8(O* p, const O (&v)[8]) {
  if constexpr (sizeof(O) == 2) {
    *reinterpret_cast<uint4*>(p) = make_uint4(
        bits16(v[0]) | (bits16(v[1]) << 16), bits16(v[2]) | (bits16(v[3]) << 16),
        bits16(v[4]) | (bits16(v[5]) << 16), bits16(v[6]) | (bits16(v[7]) << 16));
  } else {
    reinterpret_cast<uint4*>(p)[0] = make_uint4(
        __float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
    reinterpret_cast<uint4*>(p)[1] = make_uint4(
        __float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]));
  }
}

// Round through fp32 into the output dtype (exact when O == float or the value fits).
template <typename O, typename T>
__device__ __forceinline__ O to_out(T x) {
  if constexpr (cuda::std::is_same_v<O, T>) return x;
  else return static_cast<O>(static_cast<float>(x));
}

// OCP e4m3 (fp8 values, nvfp4 scales) to float, exact.
__device__ __forceinline__ float e4m3(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float mag;
  if (e == 0) mag = float(m) * 0.001953125f;  // m * 2^-9
  else if (e == 15 && m == 7) mag = __int_as_float(0x7fc00000);
  else mag = __int_as_float(int(((e + 120u) << 23) | (m << 20)));
  return (b & 0x80u) ? -mag : mag;
}

// e8m0 (mx scales) to float: 2^(e-127); 0 is 2^-127, 255 NaN.
__device__ __forceinline__ float e8m0(uint32_t e) {
  if (e == 255u) return __int_as_float(0x7fc00000);
  if (e == 0u) return __int_as_float(0x00400000);
  return __int_as_float(int(e << 23));
}

// e2m1 (fp4 values) to float, built from its bits (a table would sit in local memory).
__device__ __forceinline__ float e2m1(uint32_t b) {
  const uint32_t e = (b >> 1) & 3u, m = b & 1u;
  const float mag = e == 0 ? (m ? 0.5f : 0.0f) : __int_as_float(int(((e + 126u) << 23) | (m << 22)));
  return (b & 8u) ? -mag : mag;
}

// One octet of an affine weight: T(q) * scale + bias in the scales' dtype, then to O.
template <int BITS, typename T, typename O>
__device__ __forceinline__ void affine_octet(uint64_t q, T scale, T bias, O (&v)[8]) {
  constexpr uint32_t MASK = (1u << BITS) - 1u;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const T r = static_cast<T>(static_cast<int>(uint32_t(q >> (i * BITS)) & MASK)) * scale + bias;
    v[i] = to_out<O>(r);
  }
}

// One octet of an mxfp4/mxfp8/nvfp4 weight: float(scale) * float(value), one rounding to O.
template <int BITS, int MX, typename O>
__device__ __forceinline__ void fp_octet(uint64_t q, uint8_t s, O (&v)[8]) {
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const float scale = MX ? e8m0(s) : e4m3(s) * 1.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t d = uint32_t(q >> (i * BITS)) & MASK;
    v[i] = static_cast<O>(scale * (BITS == 8 ? e4m3(d) : e2m1(d)));
  }
}

// PTX prmt in its default mode, written out because a selector nibble's msb matters here: it
// fills the result byte with bit 7 of the byte it picks. __byte_perm is documented to use only
// each nibble's low 3 bits.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

// Values 2p, 2p+1 of an mxfp4 octet in bf16: e2m1 exactly, by byte permutes from tables of its
// 8 magnitudes' bf16 bytes (low bytes 00 00 80 C0 00 40 80 C0, high bytes 00 3F 3F 3F 40 40 40
// 40), the sign bits moved in by prmt's sign-replicating selectors (a selector nibble's msb
// copies bit 7 of the byte it picks; q << 4 puts each low value's sign at bit 7), then times the
// e8m0 scale in bf16. 23 PTX instructions an octet where the shifts and masks took ~44, bit
// for bit the same values.
__device__ __forceinline__ void mxfp4_pairs_bf16(uint32_t q, uint32_t scale2, uint32_t* out) {
  const uint32_t m = q & 0x77777777u;  // magnitudes: selectors without their msb
  const uint32_t lo03 = __byte_perm(0xC0800000u, 0xC0804000u, m), hi03 = __byte_perm(0x3F3F3F00u, 0x40404040u, m);
  const uint32_t m47 = m >> 16;
  const uint32_t lo47 = __byte_perm(0xC0800000u, 0xC0804000u, m47), hi47 = __byte_perm(0x3F3F3F00u, 0x40404040u, m47);
  const uint32_t s = q << 4;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int a = 2 * (p & 1);  // the pair's first value among its four
    const uint32_t word = __byte_perm(p < 2 ? lo03 : lo47, p < 2 ? hi03 : hi47,
                                      a | ((4 + a) << 4) | ((a + 1) << 8) | ((5 + a) << 12));
    const uint32_t sign = prmt(s, q, ((8 | p) << 4) | ((12 | p) << 12)) & 0x80008000u;
    const uint32_t v = word | sign;
    const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v),
                                     *reinterpret_cast<const __nv_bfloat162*>(&scale2));
    out[p] = *reinterpret_cast<const uint32_t*>(&r);
  }
}

// e8m0 as a bf16 (exact: bf16 has fp32's exponent range; 0 is the subnormal 2^-127).
__device__ __forceinline__ uint32_t e8m0_bf16(uint32_t e) {
  const uint32_t b = e == 255u ? 0x7FC0u : e == 0u ? 0x0040u : (e << 7);
  return b | (b << 16);
}
