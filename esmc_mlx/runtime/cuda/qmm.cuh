// The fused quantized matmul's device functions (qmm.py): its pipelined copies, mma.sync and
// the pair decodes that feed A fragments.

// A thread's two octets of a step in two weight rows ``row_b`` bytes apart (rows a and b of its
// A fragments), from shared memory: one 8-byte (4 bits) or 16-byte (8 bits) load a row, as
// words; step_octet puts octet o of a row together.
template <int BITS>
__device__ __forceinline__ void load_step_octets(
    const uint8_t* wt, int row_b, uint32_t (&qa)[2 * BITS / 4], uint32_t (&qb)[2 * BITS / 4]) {
  if constexpr (BITS == 4) {
    const uint2 ua = *reinterpret_cast<const uint2*>(wt), ub = *reinterpret_cast<const uint2*>(wt + row_b);
    qa[0] = ua.x; qa[1] = ua.y; qb[0] = ub.x; qb[1] = ub.y;
  } else {
    const uint4 ua = *reinterpret_cast<const uint4*>(wt), ub = *reinterpret_cast<const uint4*>(wt + row_b);
    qa[0] = ua.x; qa[1] = ua.y; qa[2] = ua.z; qa[3] = ua.w;
    qb[0] = ub.x; qb[1] = ub.y; qb[2] = ub.z; qb[3] = ub.w;
  }
}

template <int BITS>
__device__ __forceinline__ uint64_t step_octet(const uint32_t (&q)[2 * BITS / 4], int o) {
  return BITS == 4 ? uint64_t(q[o]) : (uint64_t(q[2 * o]) | (uint64_t(q[2 * o + 1]) << 32));
}

// 16 (or, src_bytes = 0, zero) bytes from global memory to the shared-memory address dst,
// asynchronously; and 4 bytes.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// d += a (16x16, row-major) @ b (16x8, column-major), fp32 accumulators.
template <typename O>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (cuda::std::is_same_v<O, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <typename O>
__device__ __forceinline__ uint32_t pack2(O lo, O hi) { return bits16(lo) | (bits16(hi) << 16); }

// Values 2p, 2p+1 (p = 0..3) of a 4-bit affine octet, as a pair of O, with O == T:
// O(q) exactly (the bits of 128 + q in bf16, 1024 + q in fp16, minus that constant), then
// q * scale + bias as one fma: affine_octet's arithmetic, two values at a time.
template <typename O>
__device__ __forceinline__ void affine4_pairs(uint32_t q, uint32_t scale2, uint32_t bias2, uint32_t* out) {
  constexpr uint32_t MAGIC = cuda::std::is_same_v<O, __nv_bfloat16> ? 0x43004300u : 0x64006400u;
  const uint32_t q4 = q >> 4;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    // byte p of q (values 2p, 2p + 1) and of q >> 4 into bytes 0 and 2, masked to the two
    // nibbles: one prmt where shifts and masks took four (6B forwards, fused: 0.986-0.999x)
    const uint32_t word = (__byte_perm(q, q4, p | ((4 + p) << 8)) & 0x000F000Fu) | MAGIC;
    if constexpr (cuda::std::is_same_v<O, __nv_bfloat16>) {
      const __nv_bfloat162 v = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&word),
                                       *reinterpret_cast<const __nv_bfloat162*>(&MAGIC));
      const __nv_bfloat162 r = __hfma2(v, *reinterpret_cast<const __nv_bfloat162*>(&scale2),
                                       *reinterpret_cast<const __nv_bfloat162*>(&bias2));
      out[p] = *reinterpret_cast<const uint32_t*>(&r);
    } else {
      const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&word), *reinterpret_cast<const __half2*>(&MAGIC));
      const __half2 r = __hfma2(v, *reinterpret_cast<const __half2*>(&scale2), *reinterpret_cast<const __half2*>(&bias2));
      out[p] = *reinterpret_cast<const uint32_t*>(&r);
    }
  }
}
