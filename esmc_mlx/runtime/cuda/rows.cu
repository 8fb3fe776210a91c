// Bodies of the row kernels (rows.py), one block per token row in layer_norm_rows.cuh's layout.
//@ qkv_heads

  constexpr int DH = 64, D = HEADS * DH, N = 16 / sizeof(T);
  __shared__ float red[2][2][32];
  const int t = threadIdx.x;
  const int L = qkv_shape[1];
  const size_t row = block_row();
  if (row >= size_t(qkv_shape[0]) * L) return;
  const int l = int(row % L);
  const T* src = qkv + row * (3 * D);
  const int c = N * t, j = c % DH;
  const bool active = c < D;
  const size_t dst = row * D + c;
  const float eps = __int_as_float(EPS_BITS);
  const float log2_base = __int_as_float(LOG2_BASE_BITS);

  __align__(16) T x[2][N];  // this thread's q and k values
#pragma unroll
  for (int i = 0; i < N; ++i) x[0][i] = x[1][i] = T(0);
  if (active) {
    move<N>(x[0], src + c);
    move<N>(x[1], src + D + c);
  }

  // The row's 32 RoPE angles as mx.fast.rope computes them (non-traditional: pair p is
  // (p, p + 32); inv_freq = exp2(-(p / 32) * log2(base)), scale 1, offset 0), once per row
  // rather than per element; block_sum's sync (in row_stats) publishes them.
  __shared__ float rot[2][DH / 2];
  if (t < DH / 2) {
    float d = static_cast<float>(t) / static_cast<float>(DH / 2);
    float inv_freq = exp2(-d * log2_base);
    float pos = 1.0f * static_cast<float>(l);
    float theta = pos * inv_freq;
    rot[0][t] = cos(theta);
    rot[1][t] = sin(theta);
  }

  float mean[2], rstd[2];
  row_stats<2, N>(x, active, D, eps, red, mean, rstd);

  // Normalized, times the weight, plus MLX's zero bias: rounded to T as mx.fast.layer_norm
  // writes it; RoPE reads those rounded values back as fp32.
  const T zero = T(0);
  float yq[N], yk[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const T wqi = active ? q_weight[c + i] : zero;
    const T wki = active ? k_weight[c + i] : zero;
    float norm_q = (static_cast<float>(x[0][i]) - mean[0]) * rstd[0];
    float norm_k = (static_cast<float>(x[1][i]) - mean[1]) * rstd[1];
    yq[i] = static_cast<float>(T(wqi * static_cast<T>(norm_q) + zero));
    yk[i] = static_cast<float>(T(wki * static_cast<T>(norm_k) + zero));
  }

  // The rotation in mx.fast.rope's fp32 expressions, one rounding at the end.
  const bool first = j < DH / 2;
  __align__(16) T oq[N], ok[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float pq = __shfl_xor_sync(0xffffffffu, yq[i], DH / 2 / N);
    const float pk = __shfl_xor_sync(0xffffffffu, yk[i], DH / 2 / N);
    const int p = (j + i) % (DH / 2);
    const float costheta = rot[0][p], sintheta = rot[1][p];
    float x1 = first ? yq[i] : pq, x2 = first ? pq : yq[i];
    float rx1 = x1 * costheta - x2 * sintheta;
    float rx2 = x1 * sintheta + x2 * costheta;
    oq[i] = static_cast<T>(first ? rx1 : rx2);
    x1 = first ? yk[i] : pk;
    x2 = first ? pk : yk[i];
    rx1 = x1 * costheta - x2 * sintheta;
    rx2 = x1 * sintheta + x2 * costheta;
    ok[i] = static_cast<T>(first ? rx1 : rx2);
  }
  if (active) {
    move<N>(q + dst, oq);
    move<N>(k + dst, ok);
  }

//@ add_layer_norm

  constexpr int N = 16 / sizeof(T);
  __shared__ float red[2][1][32];
  const size_t row = block_row();
  if (row >= size_t(x_shape[0])) return;
  const int c = N * threadIdx.x;
  const bool active = c < D;
  const size_t at = row * D + c;
  const float eps = __int_as_float(EPS_BITS);

  // The residual stream: x + h / scale in T, each operation rounded as MLX's ops round it.
  __align__(16) T r[1][N];
#pragma unroll
  for (int i = 0; i < N; ++i) r[0][i] = T(0);
  if (active) {
    __align__(16) T xs[N], hs[N];
    move<N>(xs, x + at);
    move<N>(hs, h + at);
    const T s = scale[0];
#pragma unroll
    for (int i = 0; i < N; ++i) r[0][i] = xs[i] + hs[i] / s;
    move<N>(residual + at, r[0]);
  }

  // mx.fast.layer_norm of it.
  float mean[1], rstd[1];
  row_stats<1, N>(r, active, D, eps, red, mean, rstd);
  if (active) {
    __align__(16) T ws[N], bs[N], out[N];
    move<N>(ws, weight + c);
    move<N>(bs, bias + c);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float norm = (static_cast<float>(r[0][i]) - mean[0]) * rstd[0];
      out[i] = ws[i] * static_cast<T>(norm) + bs[i];
    }
    move<N>(normed + at, out);
  }

