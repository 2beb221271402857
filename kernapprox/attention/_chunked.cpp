// Chunked linear attention (sum and decay rules) for the CPU: two forward kernels (1. and 2.) and the causal sum
// rule's training path (3. its backward, 4. features and their backward), registered as torch operators (the end
// of this file), built by torch.utils.cpp_extension and loaded by kernapprox/attention/native.py; the eager code of
// kernapprox/attention/linear.py (_normalized_chunked, and autograd through it) is the reference they are tested
// against, with the same stabilisers. Every product is ATen's CPU matrix product on the calling thread; the
// sequences of a batch are spread over torch's threads (at::parallel_for).
//
// 1. kernapprox::chunked_causal: the causal mode, one pass over the chunks of each sequence with the state kept in
// cache (Katharopoulos et al. 2020, eq. 9-11 for the causal sums; the chunked form of Yang et al. 2024, "Gated
// Linear Attention", sec. 3.2, with the log-domain shift of linear.py's module docstring); features come in.
// With C > 0, kernapprox::exp_attention runs the same chunk loop with the features of an exponential map (as in 2.
// below) computed per block of Lb tokens (a whole number of chunks) per sequence.
//
// Per sequence, chunk j of cl <= C tokens, positions p = 0..cl-1, a = log(gamma) (0 for the sum):
//   l'_p = l(k_p) - p a,  local_p = max_{q<=p} l'_q,  s = max(s_prev + cl a, local_{cl-1} + (cl-1) a)
//   c_p = max(local_p, s_prev + a)                                         (row shift)
//   out_p = e^{s_prev + a - c_p} phi(q_p)^T S^T + sum_{l<=p} phi(q_p)^T phi(k_l) e^{l'_l - c_p} [v_l 1]
//   S^T <- e^{s_prev + cl a - s} S^T + sum_l e^{l'_l + (cl-1) a - s} [v_l 1] phi(k_l)^T
//   log-scale of row p: l(q_p) + c_p + p a.
//
// 2. kernapprox::exp_attention with C = 0: the non-causal mode, y = phi(Q) (phi(K)^T [V 1]) (Katharopoulos et al. 2020,
// eq. 4-6), with a feature map of the exponential form computed inside the kernel, block by block while the block
// is in cache: log phi_j(x) = alpha (x W^T)_j + o_j - k alpha^2 |x|^2 / 2 + c (FAVOR+ and hyperbolic features,
// Choromanski et al. 2021, Lemma 1; the GERF family, Likhosherstov et al. 2022), stabilised per row as the
// feature maps do (kernapprox/estimators/fused.py): phi~_j = exp(p_j - max_i p_i) + eps, l = max_i p_i + c -
// k alpha^2 |x|^2 / 2 with p = alpha x W^T + o. Per sequence, a key pass over blocks of len <= L keys, each decayed
// to the block's last key (l'_t = l(k_t) + (len-1-t) a; a padded key weighs nothing):
//   s = max(s_prev + len a, max_t l'_t),  S^T <- e^{s_prev + len a - s} S^T + sum_t e^{l'_t - s} [v_t 1] phi~(k_t)^T
// then a query pass: [num den] = phi~(q)^T S^T, log-scale l(q) + s.
//
// Every exponent is <= 0; results below the smallest normal float are flushed to 0 (as the eager code does).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

namespace {

// Row-major C (M x N) = alpha op(A) op(B) + beta C (C is not read when beta = 0), by ATen's CPU matrix product
// on views of the buffers: torch's BLAS through its public API. Called inside at::parallel_for, where torch's BLAS
// runs on the calling thread only (tests/attention/test_native.py measures it).
inline void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                 int ldb, float beta, float* C, int ldc) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    float* a = const_cast<float*>(A);
    float* b = const_cast<float*>(B);
    // op(A) (M x K) and op(B) (K x N) as strided views, a transposed operand by its strides (no transpose call)
    const at::Tensor ma = ta ? at::from_blob(a, {M, K}, {1, lda}, f32) : at::from_blob(a, {M, K}, {lda, 1}, f32);
    const at::Tensor mb = tb ? at::from_blob(b, {K, N}, {1, ldb}, f32) : at::from_blob(b, {K, N}, {ldb, 1}, f32);
    at::Tensor mc = at::from_blob(C, {M, N}, {ldc, 1}, f32);
    at::cpu::addmm_out(mc, mc, ma, mb, beta, alpha);
}

// exp(x) for x <= 0 (branch-free, so that loops vectorise): Cody-Waite reduction x = n ln2 + r, a degree-6
// polynomial on |r| <= ln2/2 (relative error ~1e-7), 2^n from the exponent bits; 0 below log(FLT_MIN).
inline float exp_nonpos(float x) {
    const float lo = -87.33654475f;
    const float xc = x < lo ? lo : x;
    const float t = xc * 1.44269504088896341f + 12582912.0f;    // round(x / ln2) in the low mantissa bits
    const float n = t - 12582912.0f;
    int32_t ni;
    std::memcpy(&ni, &t, 4);
    ni -= 0x4B400000;
    float r = xc - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (ni + 127) << 23;
    float s;
    std::memcpy(&s, &bits, 4);
    return x < lo ? 0.0f : p * s;
}

constexpr float SENTINEL = -1e30f;   // the empty state's log-scale (kernapprox/rules.py)

struct Problem {
    int B, L, r, dv, C;
    float a;
    const float *pq, *lq, *pk, *lk, *v;   // pq, pk: (B, L, r); lq, lk: (B, L); v: strides v_sb, v_st
    int64_t v_sb, v_st;
    float *S, *c;                          // state (B, dv+1, r), transposed; its log-scale (B,)
    float *out, *den, *logs;               // rows: strides o_sb, o_st; den and logs: stride d_sb
    int64_t o_sb, o_st, d_sb;
    int want_num;                          // 1: write numerators; 0: numerator / normaliser
    float* states = nullptr;               // or (B, chunks, dv+1, r): the state before each chunk (for a backward)
    float* scores = nullptr;               // or (B, chunks, C, C): each chunk's weighted scores, rows of cl entries
};

// Per-thread buffers of the causal chunk loop; aug = [S^T ; phi(K_j)]: one product gives the state read and the
// intra-chunk scores of chunk j.
struct CausalWork {
    std::vector<float> lkp, local, crow, f, R, P, vb, wv, aug, RP;
    CausalWork(int C, int r, int dv1)
        : lkp(C), local(C), crow(C), f(C), R(C * dv1), P(C * C), vb(C * dv1), wv(C * dv1),
          aug((int64_t)(dv1 + C) * r), RP(C * (dv1 + C)) {}
};

// The chunks of tokens [t_begin, t_end) of sequence b (t_begin a multiple of C), the state in w.aug and its
// log-scale cb advanced in place; pq, lq, pk, lk point at token t_begin's features and log-scales.
void causal_span(const Problem& g, CausalWork& w, int b, float& cb, int t_begin, int t_end, const float* pq0,
                 const float* lq0, const float* pk0, const float* lk0) {
    const int r = g.r, dv = g.dv, dv1 = dv + 1, C = g.C;
    float* S = w.aug.data();
    for (int t0 = t_begin; t0 < t_end; t0 += C) {
        const int cl = std::min(C, t_end - t0), W = dv1 + cl;
        const float* pq = pq0 + (int64_t)(t0 - t_begin) * r;
        const float* pk = pk0 + (int64_t)(t0 - t_begin) * r;
        const float* lq = lq0 + (t0 - t_begin);
        const float* lk = lk0 + (t0 - t_begin);
        float running = -INFINITY;
        for (int p = 0; p < cl; ++p) {
            w.lkp[p] = lk[p] - p * g.a;
            running = std::max(running, w.lkp[p]);
            w.local[p] = running;
        }
        const float ce = std::max(cb + cl * g.a, w.local[cl - 1] + (cl - 1) * g.a);
        for (int p = 0; p < cl; ++p) {
            w.crow[p] = std::max(w.local[p], cb + g.a);
            w.f[p] = exp_nonpos(cb + g.a - w.crow[p]);
        }
        for (int p = 0; p < cl; ++p) {
            const float* vr = g.v + b * g.v_sb + (int64_t)(t0 + p) * g.v_st;
            const float wt = exp_nonpos(w.lkp[p] + (cl - 1) * g.a - ce);
            for (int e = 0; e < dv; ++e) {
                w.vb[p * dv1 + e] = vr[e];
                w.wv[p * dv1 + e] = vr[e] * wt;
            }
            w.vb[p * dv1 + dv] = 1.0f;
            w.wv[p * dv1 + dv] = wt;
        }
        std::memcpy(S + (int64_t)dv1 * r, pk, sizeof(float) * cl * r);
        gemm(false, true, cl, W, r, 1.0f, pq, r, S, r, 0.0f, w.RP.data(), W);
        for (int p = 0; p < cl; ++p) {
            for (int e = 0; e < dv1; ++e) w.R[p * dv1 + e] = w.RP[p * W + e] * w.f[p];
            for (int l = 0; l < cl; ++l) {
                const float wt = exp_nonpos(std::min(w.lkp[l] - w.crow[p], 0.0f));
                w.P[p * cl + l] = l <= p ? w.RP[p * W + dv1 + l] * wt : 0.0f;
            }
        }
        gemm(false, false, cl, dv1, cl, 1.0f, w.P.data(), cl, w.vb.data(), dv1, 1.0f, w.R.data(), dv1);
        if (g.states) {                       // saved for the backward (kernapprox::chunked_causal_backward)
            const int64_t chunk = (int64_t)b * ((g.L + C - 1) / C) + t0 / C;
            std::memcpy(g.states + chunk * dv1 * r, S, sizeof(float) * dv1 * r);
            std::memcpy(g.scores + chunk * C * C, w.P.data(), sizeof(float) * cl * cl);
        }
        gemm(true, false, dv1, r, cl, 1.0f, w.wv.data(), dv1, pk, r, exp_nonpos(cb + cl * g.a - ce), S, r);
        cb = ce;
        for (int p = 0; p < cl; ++p) {
            float* o = g.out + b * g.o_sb + (int64_t)(t0 + p) * g.o_st;
            const float dn = w.R[p * dv1 + dv];
            g.den[b * g.d_sb + t0 + p] = dn;
            g.logs[b * g.d_sb + t0 + p] = lq[p] + w.crow[p] + p * g.a;
            if (g.want_num) {
                for (int e = 0; e < dv; ++e) o[e] = w.R[p * dv1 + e];
            } else {
                for (int e = 0; e < dv; ++e) o[e] = w.R[p * dv1 + e] / dn;
            }
        }
    }
}

void run_sequences(const Problem& g, int b0, int b1) {
    const int r = g.r, dv1 = g.dv + 1;
    CausalWork w(g.C, r, dv1);
    for (int b = b0; b < b1; ++b) {
        float* Sg = g.S + (int64_t)b * dv1 * r;
        std::memcpy(w.aug.data(), Sg, sizeof(float) * dv1 * r);
        float cb = g.c[b];
        causal_span(g, w, b, cb, 0, g.L, g.pq + (int64_t)b * g.L * r, g.lq + (int64_t)b * g.L,
                    g.pk + (int64_t)b * g.L * r, g.lk + (int64_t)b * g.L);
        std::memcpy(Sg, w.aug.data(), sizeof(float) * dv1 * r);
        g.c[b] = cb;
    }
}


// ------------------------------------------------------------------------------------------ non-causal kernel
// Row reductions over 64 independent lanes, then a halving tree: a single running maximum or sum per row is a
// chain of dependent instructions (measured ~7x slower at r = 256).
constexpr int LANES = 64;

inline float max2(float x, float y) { return x > y ? x : y; }   // vectorises where std::max's form did not

template <bool OFFSET>
inline float row_max(const float* row, const float* o, int r) {          // max_j (row_j + o_j)
    float acc[LANES];
    for (int u = 0; u < LANES; ++u) acc[u] = -INFINITY;
    int j = 0;
    for (; j + LANES <= r; j += LANES)
        for (int u = 0; u < LANES; ++u) acc[u] = max2(acc[u], row[j + u] + (OFFSET ? o[j + u] : 0.0f));
    for (; j < r; ++j) acc[0] = max2(acc[0], row[j] + (OFFSET ? o[j] : 0.0f));
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int u = 0; u < w; ++u) acc[u] = max2(acc[u], acc[u + w]);
    return acc[0];
}

inline float lane_sum(float* acc) {
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int u = 0; u < w; ++u) acc[u] += acc[u + w];
    return acc[0];
}

inline float sum_sq(const float* x, int d) {
    float acc[LANES] = {};
    int e = 0;
    for (; e + LANES <= d; e += LANES)
        for (int u = 0; u < LANES; ++u) acc[u] += x[e + u] * x[e + u];
    for (; e < d; ++e) acc[0] += x[e] * x[e];
    return lane_sum(acc);
}

struct ExpMap {
    const float *W, *o;                    // W: (r, d) row-major; o: (r,) or null
    float alpha, c, eps, k;                // log phi_j = alpha (x W^T)_j + o_j - k alpha^2 |x|^2 / 2 + c
};

// Projections of len rows of x (row stride xs) into P (len, r), with each row's shift (the maximum of p = alpha x
// W^T + o) and log-scale.
void project(const ExpMap& m, int len, int d, int r, const float* x, int64_t xs, float* P, float* shift,
             float* ell) {
    gemm(false, true, len, r, d, m.alpha, x, (int)xs, m.W, d, 0.0f, P, r);
    for (int t = 0; t < len; ++t) {
        shift[t] = m.o ? row_max<true>(P + (int64_t)t * r, m.o, r) : row_max<false>(P + (int64_t)t * r, m.o, r);
        const float norm = m.k != 0.0f ? m.k * 0.5f * m.alpha * m.alpha * sum_sq(x + t * xs, d) : 0.0f;
        ell[t] = shift[t] + m.c - norm;
    }
}

// A key row: phi~ = exp(p + o - shift) + eps, weighted by w, written back (and added to z with SUM).
template <bool OFFSET, bool SUM>
inline void key_row(float* row, const float* o, float* z, int r, float shift, float w, float eps) {
    const float ew = eps * w;
    for (int j = 0; j < r; ++j) {
        const float e = exp_nonpos(row[j] + (OFFSET ? o[j] : 0.0f) - shift) * w + ew;
        row[j] = e;
        if (SUM) z[j] += e;
    }
}

// A query row: phi~ = exp(p + o - shift) + eps written back; returns its normaliser phi~^T z.
template <bool OFFSET>
inline float query_row(float* row, const float* o, const float* z, int r, float shift, float eps) {
    float lanes[LANES] = {};
    int j = 0;
    for (; j + LANES <= r; j += LANES)
        for (int u = 0; u < LANES; ++u) {
            const float e = exp_nonpos(row[j + u] + (OFFSET ? o[j + u] : 0.0f) - shift) + eps;
            row[j + u] = e;
            lanes[u] += e * z[j + u];
        }
    for (; j < r; ++j) {
        const float e = exp_nonpos(row[j] + (OFFSET ? o[j] : 0.0f) - shift) + eps;
        row[j] = e;
        lanes[0] += e * z[j];
    }
    return lane_sum(lanes);
}

// The inputs of the kernels that compute the features themselves: the query and key maps, the rows they map and
// the padded keys. The rest of the problem (values, state, outputs, sizes) is a Problem with L = n_q.
struct ExpInputs {
    ExpMap mq, mk;
    const float *xq, *xk;                  // rows with unit stride; strides per sequence and per token
    int64_t xq_sb, xq_st, xk_sb, xk_st;
    const unsigned char* pad;              // (B, nk) with stride pad_sb, 1 = padded key; or null
    int64_t pad_sb;
    int d, nk, Lb;                         // input dimension, keys per sequence, tokens per feature block
};

void noncausal_sequences(const Problem& g, const ExpInputs& in, int b0, int b1) {
    const int r = g.r, dv = g.dv, L = in.Lb, d = in.d;
    std::vector<float> P((int64_t)L * r), shift(L), ell(L), num((int64_t)L * dv);
    for (int b = b0; b < b1; ++b) {
        float* S = g.S + (int64_t)b * (dv + 1) * r;
        float* z = S + (int64_t)dv * r;
        float cb = g.c[b];
        for (int t0 = 0; t0 < in.nk; t0 += L) {                              // keys: the state
            const int len = std::min(L, in.nk - t0);
            const float* x = in.xk + b * in.xk_sb + (int64_t)t0 * in.xk_st;
            project(in.mk, len, d, r, x, in.xk_st, P.data(), shift.data(), ell.data());
            const unsigned char* pad = in.pad ? in.pad + b * in.pad_sb + t0 : nullptr;
            const float carried = cb + len * g.a;
            float cn = carried;
            for (int t = 0; t < len; ++t) {
                ell[t] = (pad && pad[t] ? SENTINEL : ell[t]) + (len - 1 - t) * g.a;
                cn = std::max(cn, ell[t]);
            }
            const float beta = exp_nonpos(carried - cn);
            for (int j = 0; j < r; ++j) z[j] *= beta;
            for (int t = 0; t < len; ++t) {
                float* row = P.data() + (int64_t)t * r;
                const float w = pad && pad[t] ? 0.0f : exp_nonpos(ell[t] - cn);
                if (in.mk.o) key_row<true, true>(row, in.mk.o, z, r, shift[t], w, in.mk.eps);
                else key_row<false, true>(row, nullptr, z, r, shift[t], w, in.mk.eps);
            }
            gemm(true, false, dv, r, len, 1.0f, g.v + b * g.v_sb + (int64_t)t0 * g.v_st, (int)g.v_st, P.data(), r,
                 beta, S, r);
            cb = cn;
        }
        g.c[b] = cb;
        for (int t0 = 0; t0 < g.L; t0 += L) {                              // queries: read the state
            const int len = std::min(L, g.L - t0);
            const float* x = in.xq + b * in.xq_sb + (int64_t)t0 * in.xq_st;
            project(in.mq, len, d, r, x, in.xq_st, P.data(), shift.data(), ell.data());
            float* den = g.den + b * g.d_sb + t0;
            float* logs = g.logs + b * g.d_sb + t0;
            for (int t = 0; t < len; ++t) {
                float* row = P.data() + (int64_t)t * r;
                den[t] = in.mq.o ? query_row<true>(row, in.mq.o, z, r, shift[t], in.mq.eps)
                                : query_row<false>(row, nullptr, z, r, shift[t], in.mq.eps);
                logs[t] = ell[t] + cb;
            }
            gemm(false, true, len, dv, r, 1.0f, P.data(), r, S, r, 0.0f, num.data(), dv);
            for (int t = 0; t < len; ++t) {
                float* out = g.out + b * g.o_sb + (int64_t)(t0 + t) * g.o_st;
                const float* nr = num.data() + (int64_t)t * dv;
                if (g.want_num) {
                    for (int e = 0; e < dv; ++e) out[e] = nr[e];
                } else {
                    for (int e = 0; e < dv; ++e) out[e] = nr[e] / den[t];
                }
            }
        }
    }
}


// Stabilised features of len rows (phi~ = exp(p - max p) + eps, l as project() computes it) in place in P; padded
// rows (pad[t] != 0) get zero features and the empty-state sentinel as log-scale, as the eager code gives them.
void stabilised_rows(const ExpMap& m, int len, int d, int r, const float* x, int64_t xs, const unsigned char* pad,
                     float* P, float* shift, float* ell) {
    project(m, len, d, r, x, xs, P, shift, ell);
    for (int t = 0; t < len; ++t) {
        float* row = P + (int64_t)t * r;
        if (pad && pad[t]) {
            std::memset(row, 0, sizeof(float) * r);
            ell[t] = SENTINEL;
        } else if (m.o) {
            key_row<true, false>(row, m.o, nullptr, r, shift[t], 1.0f, m.eps);
        } else {
            key_row<false, false>(row, nullptr, nullptr, r, shift[t], 1.0f, m.eps);
        }
    }
}

void causal_exp_sequences(const Problem& g, const ExpInputs& in, int b0, int b1) {
    const int r = g.r, dv1 = g.dv + 1, Lb = in.Lb;
    CausalWork w(g.C, r, dv1);
    std::vector<float> Pq((int64_t)Lb * r), Pk((int64_t)Lb * r), shift(Lb), lq(Lb), lk(Lb);
    for (int b = b0; b < b1; ++b) {
        float* Sg = g.S + (int64_t)b * dv1 * r;
        std::memcpy(w.aug.data(), Sg, sizeof(float) * dv1 * r);
        float cb = g.c[b];
        for (int t0 = 0; t0 < g.L; t0 += Lb) {
            const int len = std::min(Lb, g.L - t0);
            stabilised_rows(in.mq, len, in.d, r, in.xq + b * in.xq_sb + (int64_t)t0 * in.xq_st, in.xq_st, nullptr,
                            Pq.data(), shift.data(), lq.data());
            stabilised_rows(in.mk, len, in.d, r, in.xk + b * in.xk_sb + (int64_t)t0 * in.xk_st, in.xk_st,
                            in.pad ? in.pad + b * in.pad_sb + t0 : nullptr, Pk.data(), shift.data(), lk.data());
            causal_span(g, w, b, cb, t0, t0 + len, Pq.data(), lq.data(), Pk.data(), lk.data());
        }
        std::memcpy(Sg, w.aug.data(), sizeof(float) * dv1 * r);
        g.c[b] = cb;
    }
}

// ------------------------------------------------------------------------------------------ causal backward
// 3. kernapprox::chunked_causal_backward: the gradient of the causal sum rule's chunked mode (decay 0), the
// written-out backward of kernapprox/attention/chunk_grad.py run chunk by chunk with each state in cache. For
// y_i = n_i / d_i, [n_i d_i] = sum_{j<=i} A_ij [v_j 1], A_ij = phi~(q_i)^T phi~(k_j) e^{l(k_j) - c_i} (c_i the
// forward's row shift, the running maximum of l(k)), with h_i = [g_i / d_i, -g_i^T y_i / d_i] and vt_j = [v_j 1]:
//   dphi~(q_i) = sum_{j<=i} (h_i^T vt_j) e^{l_j - c_i} phi~(k_j)      (forward in time, state S_J)
//   dphi~(k_j) = sum_{i>=j} (h_i^T vt_j) e^{l_j - c_i} phi~(q_i)      (backward in time, reverse state R_J)
//   dvt_j      = sum_{i>=j} A_ij h_i,   dl(k_j) = phi~(k_j)^T dphi~(k_j).
// Chunk J of rows t0..t0+cl-1, s_J = c at its last row, s_{J-1} at the row before it (the sentinel for J = 0):
//   S_J = sum_{j before J} e^{l_j - s_{J-1}} vt_j phi~(k_j)^T         ((dv+1) x r; every factor <= 1)
//   R_J = sum_{i after J} e^{s_J - c_i} h_i phi~(q_i)^T
//   dphi~(Q_J) = [e^{s_{J-1} - c} h | G] [S_J ; phi~(K_J)],   G_ij = (h_i^T vt_j) e^{l_j - c_i} (j <= i)
//   dphi~(K_J) = [e^{l - s_J} vt | G^T] [R_J ; phi~(Q_J)],   dvt_J = e^{l - s_J} phi~(K_J) R_J^T + P^T h,
//   P_ij = phi~(q_i)^T phi~(k_j) e^{l_j - c_i} (j <= i); phi~(K_J) [R_J ; phi~(Q_J)]^T gives both products at once.
// dx of len rows from dphi~ (and dl, or null), the row shift held constant (4. below): dp = dphi~ (phi~ - eps)
// into gp (len x r), dx = alpha dp W - k alpha^2 dl x into gx (row stride d).
void feature_grad_rows(const ExpMap& m, int len, int d, int r, const float* x, const float* phi, const float* gphi,
                       const float* gell, float* gp, float* gx) {
    for (int64_t u = 0; u < (int64_t)len * r; ++u) gp[u] = gphi[u] * (phi[u] - m.eps);
    gemm(false, false, len, d, r, m.alpha, gp, r, m.W, d, 0.0f, gx, d);
    if (gell && m.k != 0.0f) {
        const float f = -m.k * m.alpha * m.alpha;
        for (int t = 0; t < len; ++t) {
            const float gl = gell[t] * f;
            for (int e = 0; e < d; ++e) gx[(int64_t)t * d + e] += gl * x[(int64_t)t * d + e];
        }
    }
}

struct Backward {
    int B, L, r, dv, C;
    const float *pq, *pk, *lk, *v, *y, *den, *c, *gy;   // (B, L, r) x 2; (B, L); (B, L, dv) x 2; (B, L) x 2; (B, L, dv)
    float *gpq, *gpk, *glk, *gv;                         // (B, L, r) x 2; (B, L); (B, L, dv): all contiguous
    const float *states, *scores;                        // the forward's S_J and P_J (Problem), or null
    // fused with the features' backward (kernapprox::exp_causal_backward): the maps, their rows (B, L, d), and
    // dx of the rows in place of dphi~ (gpq, gpk and glk then unused)
    const ExpMap *mq = nullptr, *mk = nullptr;
    const float *xq = nullptr, *xk = nullptr;
    float *gxq = nullptr, *gxk = nullptr;
    int d = 0;
};

struct BackwardWork {
    std::vector<float> h, vt, hw, A, T, M, P, aug, gvt, gf, gp, gl;
    BackwardWork(int C, int r, int dv1, bool fused)
        : h(C * dv1), vt(C * dv1), hw(C * dv1), A(C * (dv1 + C)), T(C * (dv1 + C)), M(C * C), P(C * C),
          aug((int64_t)(dv1 + C) * r), gvt(C * dv1), gf(fused ? (int64_t)C * r : 0), gp(fused ? (int64_t)C * r : 0),
          gl(C) {}
};

// h and vt of rows t0..t0+cl-1 of sequence b.
inline void backward_rows(const Backward& g, BackwardWork& w, int b, int t0, int cl) {
    const int dv = g.dv, dv1 = dv + 1;
    for (int p = 0; p < cl; ++p) {
        const int64_t row = (int64_t)b * g.L + t0 + p;
        const float *vr = g.v + row * dv, *yr = g.y + row * dv, *gr = g.gy + row * dv;
        const float inv = 1.0f / g.den[row];
        float dot = 0.0f;
        for (int e = 0; e < dv; ++e) {
            dot += gr[e] * yr[e];
            w.h[p * dv1 + e] = gr[e] * inv;
            w.vt[p * dv1 + e] = vr[e];
        }
        w.h[p * dv1 + dv] = -dot * inv;
        w.vt[p * dv1 + dv] = 1.0f;
    }
}

void backward_sequence(const Backward& g, BackwardWork& w, int b) {
    const int r = g.r, dv = g.dv, dv1 = dv + 1, C = g.C, L = g.L;
    const int64_t base = (int64_t)b * L;
    const int chunks = (L + C - 1) / C;
    const float *c = g.c + base, *lk = g.lk + base;
    float* S = w.aug.data();                             // [S_J ; phi~(K_J)], then [R_J ; phi~(Q_J)]
    // forward in time: dphi~(Q)
    std::memset(S, 0, sizeof(float) * dv1 * r);
    float sprev = SENTINEL;
    for (int t0 = 0; t0 < L; t0 += C) {
        const int cl = std::min(C, L - t0), W = dv1 + cl;
        const float* pk = g.pk + (base + t0) * r;
        const float s = c[t0 + cl - 1];
        backward_rows(g, w, b, t0, cl);
        gemm(false, true, cl, cl, dv1, 1.0f, w.h.data(), dv1, w.vt.data(), dv1, 0.0f, w.M.data(), cl);
        for (int p = 0; p < cl; ++p) {
            const float ci = c[t0 + p];
            const float f = exp_nonpos(std::min(sprev - ci, 0.0f));
            for (int e = 0; e < dv1; ++e) w.A[p * W + e] = w.h[p * dv1 + e] * f;
            for (int l = 0; l < cl; ++l)
                w.A[p * W + dv1 + l] = l <= p ? w.M[p * cl + l] * exp_nonpos(std::min(lk[t0 + l] - ci, 0.0f)) : 0.0f;
        }
        if (g.states)
            std::memcpy(S, g.states + (int64_t)(b * chunks + t0 / C) * dv1 * r, sizeof(float) * dv1 * r);
        std::memcpy(S + (int64_t)dv1 * r, pk, sizeof(float) * cl * r);
        if (g.mq) {                                      // dphi~(Q_J) in cache, then dx of the query rows
            gemm(false, false, cl, r, W, 1.0f, w.A.data(), W, S, r, 0.0f, w.gf.data(), r);
            feature_grad_rows(*g.mq, cl, g.d, r, g.xq + (base + t0) * g.d, g.pq + (base + t0) * r, w.gf.data(),
                              nullptr, w.gp.data(), g.gxq + (base + t0) * g.d);
        } else {
            gemm(false, false, cl, r, W, 1.0f, w.A.data(), W, S, r, 0.0f, g.gpq + (base + t0) * r, r);
        }
        if (!g.states) {                                 // the state after chunk J, unless the forward saved it
            for (int p = 0; p < cl; ++p) {
                const float kw = exp_nonpos(std::min(lk[t0 + p] - s, 0.0f));
                for (int e = 0; e < dv1; ++e) w.hw[p * dv1 + e] = w.vt[p * dv1 + e] * kw;
            }
            gemm(true, false, dv1, r, cl, 1.0f, w.hw.data(), dv1, pk, r, exp_nonpos(std::min(sprev - s, 0.0f)), S,
                 r);
        }
        sprev = s;
    }
    // backward in time: dphi~(K), dv, dl(K)
    float* R = S;
    std::memset(R, 0, sizeof(float) * dv1 * r);
    for (int t0 = (L - 1) / C * C; t0 >= 0; t0 -= C) {
        const int cl = std::min(C, L - t0), W = dv1 + cl;
        const float* pq = g.pq + (base + t0) * r;
        const float* pk = g.pk + (base + t0) * r;
        const float s = c[t0 + cl - 1];
        const float sprev_j = t0 > 0 ? c[t0 - 1] : SENTINEL;
        backward_rows(g, w, b, t0, cl);
        std::memcpy(R + (int64_t)dv1 * r, pq, sizeof(float) * cl * r);
        const float* saved = g.scores ? g.scores + (int64_t)(b * chunks + t0 / C) * C * C : nullptr;
        const int TW = saved ? dv1 : W;                  // [pk R^T], or [pk R^T | pk pq^T] without saved scores
        gemm(false, true, cl, TW, r, 1.0f, pk, r, R, r, 0.0f, w.T.data(), TW);
        gemm(false, true, cl, cl, dv1, 1.0f, w.vt.data(), dv1, w.h.data(), dv1, 0.0f, w.M.data(), cl);  // vt h^T
        for (int j = 0; j < cl; ++j) {
            const float kw = exp_nonpos(std::min(lk[t0 + j] - s, 0.0f));
            for (int e = 0; e < dv1; ++e) {
                w.A[j * W + e] = w.vt[j * dv1 + e] * kw;
                w.gvt[j * dv1 + e] = w.T[j * TW + e] * kw;
            }
            for (int i = 0; i < cl; ++i) {
                const float wt = i >= j ? exp_nonpos(std::min(lk[t0 + j] - c[t0 + i], 0.0f)) : 0.0f;
                w.A[j * W + dv1 + i] = w.M[j * cl + i] * wt;
                if (!saved) w.P[j * cl + i] = w.T[j * W + dv1 + i] * wt;
            }
        }
        if (saved)                                       // P^T h with P_ij (row i, cl entries) as the forward kept it
            gemm(true, false, cl, dv1, cl, 1.0f, saved, cl, w.h.data(), dv1, 1.0f, w.gvt.data(), dv1);
        else
            gemm(false, false, cl, dv1, cl, 1.0f, w.P.data(), cl, w.h.data(), dv1, 1.0f, w.gvt.data(), dv1);
        float* gpk = g.mk ? w.gf.data() : g.gpk + (base + t0) * r;
        float* glk = g.mk ? w.gl.data() : g.glk + base + t0;
        gemm(false, false, cl, r, W, 1.0f, w.A.data(), W, R, r, 0.0f, gpk, r);
        for (int j = 0; j < cl; ++j) {
            float* gvr = g.gv + (base + t0 + j) * dv;
            for (int e = 0; e < dv; ++e) gvr[e] = w.gvt[j * dv1 + e];
            float lanes[LANES] = {};
            const float *a = gpk + (int64_t)j * r, *x = pk + (int64_t)j * r;
            int u0 = 0;
            for (; u0 + LANES <= r; u0 += LANES)
                for (int u = 0; u < LANES; ++u) lanes[u] += a[u0 + u] * x[u0 + u];
            for (; u0 < r; ++u0) lanes[0] += a[u0] * x[u0];
            glk[j] = lane_sum(lanes);
        }
        if (g.mk)                                        // dx of the key rows, dl(K_J) through the norm term
            feature_grad_rows(*g.mk, cl, g.d, r, g.xk + (base + t0) * g.d, pk, gpk, glk, w.gp.data(),
                              g.gxk + (base + t0) * g.d);
        for (int p = 0; p < cl; ++p) {
            const float rw = exp_nonpos(std::min(sprev_j - c[t0 + p], 0.0f));
            for (int e = 0; e < dv1; ++e) w.hw[p * dv1 + e] = w.h[p * dv1 + e] * rw;
        }
        gemm(true, false, dv1, r, cl, 1.0f, w.hw.data(), dv1, pq, r, exp_nonpos(std::min(sprev_j - s, 0.0f)), R, r);
    }
}

void backward_sequences(const Backward& g, int b0, int b1) {
    BackwardWork w(g.C, g.r, g.dv + 1, g.mq != nullptr);
    for (int b = b0; b < b1; ++b) backward_sequence(g, w, b);
}

// ------------------------------------------------------------------------------------------ features and backward
// 4. kernapprox::exp_features: the stabilised features of a map of the exponential form (as in 2.:
// phi~ = exp(p - max p) + eps, l = max p + c - k alpha^2 |x|^2 / 2, p = alpha x W^T + o) for N rows, in blocks of
// FEATURE_ROWS rows per task of torch's threads, each block's projections and exponentials in cache.
// kernapprox::exp_causal_backward runs 3. with the features' backward fused into its chunk loop (feature_grad_rows
// on each chunk's dphi~ while it is in cache), the row shift held constant (exact when eps = 0:
// phi~ e^l = exp(p + c - k alpha^2 |x|^2 / 2) does not depend on it; the eager maps detach it then):
//   dp = dphi~ (phi~ - eps),   dx = alpha dp W - k alpha^2 dl x,
// so dx of the query and key rows comes out with no (n, r) gradient stored.
constexpr int FEATURE_ROWS = 256;

void features_rows(const ExpMap& m, int N, int d, int r, const float* x, float* phi, float* ell) {
    at::parallel_for(0, (N + FEATURE_ROWS - 1) / FEATURE_ROWS, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> shift(FEATURE_ROWS);
        for (int64_t i = i0; i < i1; ++i) {
            const int t0 = (int)i * FEATURE_ROWS, len = std::min(FEATURE_ROWS, N - t0);
            stabilised_rows(m, len, d, r, x + (int64_t)t0 * d, d, nullptr, phi + (int64_t)t0 * r, shift.data(),
                            ell + t0);
        }
    });
}

// Sequences b0..b1-1 of B per thread of torch's pool (at::parallel_for: one range of sequences per thread).
template <class Fn>
void over_sequences(int B, Fn run) {
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) { run((int)b0, (int)b1); });
}

}  // namespace

// ------------------------------------------------------------------------------------------------ the operators
// Registered with torch's dispatcher as kernapprox::chunked_causal, kernapprox::exp_attention and
// kernapprox::exp_nonpos (CPU); kernapprox/attention/native.py registers their shape-only (fake) versions for
// torch.compile. Every operator writes into the tensors marked (x!) in its schema and returns nothing.
namespace {

const float* f32(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
    return t.data_ptr<float>();
}

float* f32_out(const at::Tensor& t, const char* name) { return const_cast<float*>(f32(t, name)); }

const float* f32_rows(const at::Tensor& t, const char* name) {        // (B, n, m), unit stride within a row
    TORCH_CHECK(t.dim() == 3 && (t.size(2) <= 1 || t.stride(2) == 1), name, " must be (B, n, m) with rows of unit "
                "stride");
    return f32(t, name);
}

const float* f32_dense(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
    return f32(t, name);
}

void check_outputs(const at::Tensor& state, const at::Tensor& c, const at::Tensor& out, const at::Tensor& den,
                   const at::Tensor& logs, int64_t B, int64_t n, int64_t dv, int64_t r) {
    TORCH_CHECK(state.is_contiguous() && state.dim() == 3 && state.size(0) == B && state.size(1) == dv + 1 &&
                state.size(2) == r, "state must be a contiguous (B, d_v+1, r) tensor");
    TORCH_CHECK(c.is_contiguous() && c.numel() == B, "c must be a contiguous (B,) tensor");
    TORCH_CHECK(out.dim() == 3 && out.size(0) == B && out.size(1) == n && out.size(2) == dv &&
                (dv <= 1 || out.stride(2) == 1), "out must be (B, n, d_v) with rows of unit stride");
    TORCH_CHECK(den.dim() == 2 && den.size(0) == B && den.size(1) == n && (n <= 1 || den.stride(1) == 1) &&
                logs.sizes() == den.sizes() && logs.strides() == den.strides(),
                "den and logs must be (B, n) with one layout and unit stride");
}

// The dimensions (B, L, r, d_v) every causal chunk-loop operator checks the same way.
struct Dims {
    int64_t B, L, r, dv;
};

Dims chunk_dims(const at::Tensor& pq, const at::Tensor& pk, const at::Tensor& v, int64_t chunk_size) {
    TORCH_CHECK(pq.dim() == 3 && pq.sizes() == pk.sizes(), "pq and pk must be (B, L, r) of one shape");
    TORCH_CHECK(v.dim() == 3, "v must be (B, L, d_v)");
    const Dims n{pq.size(0), pq.size(1), pq.size(2), v.size(2)};
    TORCH_CHECK(n.B >= 1 && n.L >= 1 && n.r >= 1 && n.dv >= 1 && chunk_size >= 1, "empty problem or chunk size < 1");
    TORCH_CHECK(v.size(0) == n.B && v.size(1) == n.L, "v must be (B, L, d_v)");
    return n;
}

// The forward's saved per-chunk states (B, chunks, d_v+1, r) and intra-chunk scores (B, chunks, C, C).
void check_saved(const at::Tensor& states, const at::Tensor& scores, const Dims& n, int64_t chunk_size) {
    const int64_t chunks = (n.L + chunk_size - 1) / chunk_size;
    TORCH_CHECK(states.dim() == 4 && states.size(0) == n.B && states.size(1) == chunks &&
                states.size(2) == n.dv + 1 && states.size(3) == n.r, "states must be (B, chunks, d_v+1, r)");
    TORCH_CHECK(scores.dim() == 4 && scores.size(0) == n.B && scores.size(1) == chunks &&
                scores.size(2) == chunk_size && scores.size(3) == chunk_size, "scores must be (B, chunks, C, C)");
    TORCH_CHECK(states.is_contiguous() && scores.is_contiguous(), "states and scores must be contiguous");
}

// Whether the optional pair is given (both or neither), checked when it is.
bool saved_pair(const std::optional<at::Tensor>& states, const std::optional<at::Tensor>& scores, const Dims& n,
                int64_t chunk_size) {
    TORCH_CHECK(states.has_value() == scores.has_value(), "states and scores are saved together");
    if (states.has_value()) check_saved(*states, *scores, n, chunk_size);
    return states.has_value();
}

void chunked_causal(const at::Tensor& pq, const at::Tensor& lq, const at::Tensor& pk, const at::Tensor& lk,
                    const at::Tensor& v, const at::Tensor& state, const at::Tensor& c, const at::Tensor& out,
                    const at::Tensor& den, const at::Tensor& logs, int64_t chunk_size, double log_decay,
                    bool want_num, const std::optional<at::Tensor>& states, const std::optional<at::Tensor>& scores) {
    const Dims n = chunk_dims(pq, pk, v, chunk_size);
    const int64_t B = n.B, L = n.L, r = n.r, dv = n.dv;
    TORCH_CHECK(lq.dim() == 2 && lq.size(0) == B && lq.size(1) == L && lk.sizes() == lq.sizes(),
                "lq and lk must be (B, L)");
    check_outputs(state, c, out, den, logs, B, L, dv, r);
    const Problem g{(int)B, (int)L, (int)r, (int)dv, (int)chunk_size, (float)log_decay, f32_dense(pq, "pq"),
                    f32_dense(lq, "lq"), f32_dense(pk, "pk"), f32_dense(lk, "lk"), f32_rows(v, "v"), v.stride(0),
                    v.stride(1), f32_out(state, "state"), f32_out(c, "c"), f32_out(out, "out"), f32_out(den, "den"),
                    f32_out(logs, "logs"), out.stride(0), out.stride(1), den.stride(0), want_num ? 1 : 0};
    Problem gs = g;
    if (saved_pair(states, scores, n, chunk_size)) {
        gs.states = f32_out(*states, "states");
        gs.scores = f32_out(*scores, "scores");
    }
    over_sequences((int)B, [&](int b0, int b1) { run_sequences(gs, b0, b1); });
}

void chunked_causal_backward(const at::Tensor& pq, const at::Tensor& pk, const at::Tensor& lk, const at::Tensor& v,
                             const at::Tensor& y, const at::Tensor& den, const at::Tensor& c, const at::Tensor& gy,
                             const at::Tensor& gpq, const at::Tensor& gpk, const at::Tensor& glk,
                             const at::Tensor& gv, int64_t chunk_size, const std::optional<at::Tensor>& states,
                             const std::optional<at::Tensor>& scores) {
    const Dims n = chunk_dims(pq, pk, v, chunk_size);
    const int64_t B = n.B, L = n.L, r = n.r, dv = n.dv;
    for (const at::Tensor* t : {&lk, &den, &c, &glk})
        TORCH_CHECK(t->dim() == 2 && t->size(0) == B && t->size(1) == L, "lk, den, c and glk must be (B, L)");
    for (const at::Tensor* t : {&v, &y, &gy, &gv})
        TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == L && t->size(2) == dv,
                    "v, y, gy and gv must be (B, L, d_v)");
    TORCH_CHECK(gpq.sizes() == pq.sizes() && gpk.sizes() == pq.sizes(), "gpq and gpk must be (B, L, r)");
    const Backward g{(int)B, (int)L, (int)r, (int)dv, (int)chunk_size, f32_dense(pq, "pq"), f32_dense(pk, "pk"),
                     f32_dense(lk, "lk"), f32_dense(v, "v"), f32_dense(y, "y"), f32_dense(den, "den"),
                     f32_dense(c, "c"), f32_dense(gy, "gy"), const_cast<float*>(f32_dense(gpq, "gpq")),
                     const_cast<float*>(f32_dense(gpk, "gpk")), const_cast<float*>(f32_dense(glk, "glk")),
                     const_cast<float*>(f32_dense(gv, "gv")), nullptr, nullptr};
    Backward gs = g;
    if (saved_pair(states, scores, n, chunk_size)) {
        gs.states = f32_dense(*states, "states");
        gs.scores = f32_dense(*scores, "scores");
    }
    over_sequences((int)B, [&](int b0, int b1) { backward_sequences(gs, b0, b1); });
}

ExpMap exp_map(const at::Tensor& W, const std::optional<at::Tensor>& o, at::ArrayRef<double> scalars, int64_t d,
               const char* name) {
    TORCH_CHECK(W.dim() == 2 && W.size(1) == d, name, ": the weight must be (r, d)");
    TORCH_CHECK(scalars.size() == 4, name, ": the map's scalars are [alpha, c, eps, k]");
    const float* offset = nullptr;
    if (o.has_value()) {
        TORCH_CHECK(o->numel() == W.size(0), name, ": the offset must have r entries");
        offset = f32_dense(*o, "offset");
    }
    return ExpMap{f32_dense(W, "weight"), offset, (float)scalars[0], (float)scalars[1], (float)scalars[2],
                  (float)scalars[3]};
}

void exp_causal_backward(const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& wq, at::ArrayRef<double> mapq,
                         const at::Tensor& wk, at::ArrayRef<double> mapk, const at::Tensor& pq, const at::Tensor& pk,
                         const at::Tensor& lk, const at::Tensor& v, const at::Tensor& y, const at::Tensor& den,
                         const at::Tensor& c, const at::Tensor& gy, const at::Tensor& states, const at::Tensor& scores,
                         const at::Tensor& gxq, const at::Tensor& gxk, const at::Tensor& gv, int64_t chunk_size) {
    const Dims n = chunk_dims(pq, pk, v, chunk_size);
    const int64_t B = n.B, L = n.L, r = n.r, dv = n.dv, d = xq.size(-1);
    TORCH_CHECK(d >= 1, "xq must be (B, L, d) with d >= 1");
    for (const at::Tensor* t : {&xq, &xk, &gxq, &gxk})
        TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == L && t->size(2) == d,
                    "xq, xk, gxq and gxk must be (B, L, d)");
    for (const at::Tensor* t : {&lk, &den, &c})
        TORCH_CHECK(t->dim() == 2 && t->size(0) == B && t->size(1) == L, "lk, den and c must be (B, L)");
    for (const at::Tensor* t : {&v, &y, &gy, &gv})
        TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == L && t->size(2) == dv,
                    "v, y, gy and gv must be (B, L, d_v)");
    TORCH_CHECK(wq.size(0) == r && wk.size(0) == r, "the maps' weights must be (r, d)");
    check_saved(states, scores, n, chunk_size);
    const ExpMap mq = exp_map(wq, std::nullopt, mapq, d, "query map");
    const ExpMap mk = exp_map(wk, std::nullopt, mapk, d, "key map");
    Backward g{(int)B, (int)L, (int)r, (int)dv, (int)chunk_size, f32_dense(pq, "pq"), f32_dense(pk, "pk"),
               f32_dense(lk, "lk"), f32_dense(v, "v"), f32_dense(y, "y"), f32_dense(den, "den"), f32_dense(c, "c"),
               f32_dense(gy, "gy"), nullptr, nullptr, nullptr, const_cast<float*>(f32_dense(gv, "gv")),
               f32_dense(states, "states"), f32_dense(scores, "scores")};
    g.mq = &mq;
    g.mk = &mk;
    g.xq = f32_dense(xq, "xq");
    g.xk = f32_dense(xk, "xk");
    g.gxq = const_cast<float*>(f32_dense(gxq, "gxq"));
    g.gxk = const_cast<float*>(f32_dense(gxk, "gxk"));
    g.d = (int)d;
    over_sequences((int)B, [&](int b0, int b1) { backward_sequences(g, b0, b1); });
}

void exp_features(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& o,
                  at::ArrayRef<double> map, const at::Tensor& phi, const at::Tensor& ell) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x must be (N, d)");
    const int64_t N = x.size(0), d = x.size(1), r = w.size(0);
    const ExpMap m = exp_map(w, o, map, d, "map");
    TORCH_CHECK(phi.dim() == 2 && phi.size(0) == N && phi.size(1) == r && ell.dim() == 1 && ell.size(0) == N,
                "phi must be (N, r) and ell (N,)");
    features_rows(m, (int)N, (int)d, (int)r, f32_dense(x, "x"), const_cast<float*>(f32_dense(phi, "phi")),
                  const_cast<float*>(f32_dense(ell, "ell")));
}

void exp_attention(const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& wq,
                   const std::optional<at::Tensor>& oq, at::ArrayRef<double> mapq, const at::Tensor& wk,
                   const std::optional<at::Tensor>& ok, at::ArrayRef<double> mapk,
                   const std::optional<at::Tensor>& padding, const at::Tensor& v, const at::Tensor& state,
                   const at::Tensor& c, const at::Tensor& out, const at::Tensor& den, const at::Tensor& logs,
                   int64_t chunk_size, int64_t block, double log_decay, bool want_num) {
    const float* pxq = f32_rows(xq, "xq");
    const float* pxk = f32_rows(xk, "xk");
    const int64_t B = xq.size(0), nq = xq.size(1), nk = xk.size(1), d = xq.size(2), r = wq.size(0), dv = v.size(-1);
    TORCH_CHECK(B >= 1 && d >= 1 && r >= 1 && dv >= 1 && block >= 1 && chunk_size >= 0, "empty problem");
    TORCH_CHECK(xk.size(0) == B && xk.size(2) == d && wk.size(0) == r, "xq, xk and the maps disagree in shape");
    TORCH_CHECK(chunk_size == 0 || (nq == nk && nq >= 1 && block >= chunk_size && block % chunk_size == 0),
                "causal: n_q = n_k and a block of whole chunks");
    TORCH_CHECK(v.size(0) == B && v.size(1) == nk, "v must be (B, n_k, d_v)");
    check_outputs(state, c, out, den, logs, B, nq, dv, r);
    const unsigned char* pad = nullptr;
    int64_t pad_sb = 0;
    if (padding.has_value()) {
        TORCH_CHECK(padding->scalar_type() == at::kBool && padding->dim() == 2 && padding->size(0) == B &&
                    padding->size(1) == nk && (nk <= 1 || padding->stride(1) == 1), "padding must be (B, n_k) bool");
        pad = reinterpret_cast<const unsigned char*>(padding->data_ptr<bool>());
        pad_sb = padding->stride(0);
    }
    const Problem g{(int)B, (int)nq, (int)r, (int)dv, (int)chunk_size, (float)log_decay, nullptr, nullptr, nullptr,
                    nullptr, f32_rows(v, "v"), v.stride(0), v.stride(1), f32_out(state, "state"), f32_out(c, "c"),
                    f32_out(out, "out"), f32_out(den, "den"), f32_out(logs, "logs"), out.stride(0), out.stride(1),
                    den.stride(0), want_num ? 1 : 0};
    const ExpInputs in{exp_map(wq, oq, mapq, d, "query map"), exp_map(wk, ok, mapk, d, "key map"), pxq, pxk,
                       xq.stride(0), xq.stride(1), xk.stride(0), xk.stride(1), pad, pad_sb, (int)d, (int)nk,
                       (int)block};
    if (chunk_size > 0)
        over_sequences((int)B, [&](int b0, int b1) { causal_exp_sequences(g, in, b0, b1); });
    else
        over_sequences((int)B, [&](int b0, int b1) { noncausal_sequences(g, in, b0, b1); });
}

// out = exp(src) over every entry (<= 0) by the kernels' exp, on torch's threads: for the benchmarks' roofline,
// which charges every exp at the fastest rate measured on the machine.
void exp_nonpos_op(const at::Tensor& src, const at::Tensor& out) {
    TORCH_CHECK(src.numel() == out.numel(), "src and out differ in size");
    const float* s = f32_dense(src, "src");
    float* o = const_cast<float*>(f32_dense(out, "out"));
    at::parallel_for(0, src.numel(), 1 << 14, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) o[i] = exp_nonpos(s[i]);
    });
}

}  // namespace

TORCH_LIBRARY(kernapprox, m) {
    m.def("chunked_causal(Tensor pq, Tensor lq, Tensor pk, Tensor lk, Tensor v, Tensor(a!) state, Tensor(b!) c, "
          "Tensor(c!) out, Tensor(d!) den, Tensor(e!) logs, int chunk_size, float log_decay, bool want_num, "
          "Tensor(f!)? states=None, Tensor(g!)? scores=None) -> ()");
    m.def("exp_attention(Tensor xq, Tensor xk, Tensor wq, Tensor? oq, float[] mapq, Tensor wk, Tensor? ok, "
          "float[] mapk, Tensor? padding, Tensor v, Tensor(a!) state, Tensor(b!) c, Tensor(c!) out, Tensor(d!) den, "
          "Tensor(e!) logs, int chunk_size, int block, float log_decay, bool want_num) -> ()");
    m.def("exp_nonpos(Tensor src, Tensor(a!) out) -> ()");
    m.def("chunked_causal_backward(Tensor pq, Tensor pk, Tensor lk, Tensor v, Tensor y, Tensor den, Tensor c, "
          "Tensor gy, Tensor(a!) gpq, Tensor(b!) gpk, Tensor(c!) glk, Tensor(d!) gv, int chunk_size, "
          "Tensor? states=None, Tensor? scores=None) -> ()");
    m.def("exp_features(Tensor x, Tensor w, Tensor? o, float[] map, Tensor(a!) phi, Tensor(b!) ell) -> ()");
    m.def("exp_causal_backward(Tensor xq, Tensor xk, Tensor wq, float[] mapq, Tensor wk, float[] mapk, Tensor pq, "
          "Tensor pk, Tensor lk, Tensor v, Tensor y, Tensor den, Tensor c, Tensor gy, Tensor states, Tensor scores, "
          "Tensor(a!) gxq, Tensor(b!) gxk, Tensor(c!) gv, int chunk_size) -> ()");
}

TORCH_LIBRARY_IMPL(kernapprox, CPU, m) {
    m.impl("chunked_causal", &chunked_causal);
    m.impl("exp_attention", &exp_attention);
    m.impl("exp_nonpos", &exp_nonpos_op);
    m.impl("chunked_causal_backward", &chunked_causal_backward);
    m.impl("exp_features", &exp_features);
    m.impl("exp_causal_backward", &exp_causal_backward);
}
