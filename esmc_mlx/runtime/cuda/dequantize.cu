// Bodies of the dequantize kernels (dequantize.py builds one kernel per weight count, mode, bits
// and group size): a grid-stride loop over the octets (8 values) of one or more packed weights,
// each octet decoded by octets.cuh and written with one 128-bit store. %K is a weight's index,
// %J the one before it (_ for the first), ENDS and %L the loop's bounds, BODY an octet body.
//@ start
  size_t end_ = 0, ENDS;  // where each weight's octets end (end_: the first's start)

//@ end_decl
end%K = 0
//@ size
  {
    size_t words = 1;
    for (int d = 0; d < w%K_ndim; ++d) words *= w%K_shape[d];
    end%K = end%J + words * 4 / BITS;  // 8 values = BITS bytes
  }

//@ loop
  const size_t step = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end%L; i += step) {

//@ weight_octets
    if (i < end%K) {  // weight %K
      const size_t o = i - end%J;
      const uint8_t* packed = reinterpret_cast<const uint8_t*>(w%K);
      const auto* scales = scales%K;
      const auto* biases = biases%K;
      auto* out = values + end%J * 8;  // the output holds every weight's values, in order
      const uint64_t q = load_octet<BITS>(packed + o * BITS);
      const size_t g = o * 8 / GROUP;  // an octet never straddles a group (groups: 16-128)
BODY
      continue;
    }

//@ affine

    O v[8];
    affine_octet<BITS, T, O>(q, scales[g], biases[g], v);
    store8<O>(out + o * 8, v);

//@ fp

    O v[8];
    fp_octet<BITS, MX, O>(q, scales[g], v);
    store8<O>(out + o * 8, v);

//@ fp_pairs

    uint32_t v[4];
    mxfp4_pairs_bf16(uint32_t(q), e8m0_bf16(scales[g]), v);
    *reinterpret_cast<uint4*>(out + o * 8) = make_uint4(v[0], v[1], v[2], v[3]);

//@ close
  }

