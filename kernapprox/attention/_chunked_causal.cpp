// Causal chunked linear attention (sum and decay rules) for the CPU: one pass over the chunks of each sequence,
// the state kept in cache, every product a single-threaded BLAS call, the sequences of a batch spread over the
// OpenMP threads. Built and loaded by kernapprox/attention/native.py; the eager code of
// kernapprox/attention/linear.py (_chunked_causal) is the reference it is tested against, with the same
// stabilisers (Katharopoulos et al. 2020, eq. 9-11 for the causal sums; the chunked form of Yang et al. 2024,
// "Gated Linear Attention", sec. 3.2, with the log-domain shift of linear.py's module docstring).
//
// Per sequence, chunk j of cl <= C tokens, positions p = 0..cl-1, a = log(gamma) (0 for the sum):
//   l'_p = l(k_p) - p a,  local_p = max_{q<=p} l'_q,  s = max(s_prev + cl a, local_{cl-1} + (cl-1) a)
//   c_p = max(local_p, s_prev + a)                                         (row shift)
//   out_p = e^{s_prev + a - c_p} phi(q_p)^T S^T + sum_{l<=p} phi(q_p)^T phi(k_l) e^{l'_l - c_p} [v_l 1]
//   S^T <- e^{s_prev + cl a - s} S^T + sum_l e^{l'_l + (cl-1) a - s} [v_l 1] phi(k_l)^T
//   log-scale of row p: l(q_p) + c_p + p a.
// Every exponent is <= 0; results below the smallest normal float are flushed to 0 (as the eager code does).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

extern "C" {
// Fortran BLAS and MKL's thread control, exported by libtorch_cpu (PyTorch builds with MKL).
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*);
int MKL_Set_Num_Threads_Local(int);
}

namespace {

// Row-major C (M x N) = alpha op(A) op(B) + beta C, through the column-major BLAS (C^T = op(B)^T op(A)^T).
inline void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                 int ldb, float beta, float* C, int ldc) {
    const char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
    sgemm_(&b, &a, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
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

struct Problem {
    int B, L, r, dv, C;
    float a;
    const float *pq, *lq, *pk, *lk, *v;   // pq, pk: (B, L, r); lq, lk: (B, L); v: strides v_sb, v_st
    int64_t v_sb, v_st;
    float *S, *c;                          // state (B, dv+1, r), transposed; its log-scale (B,)
    float *out, *den, *logs;               // rows: strides o_sb, o_st; den and logs: stride d_sb
    int64_t o_sb, o_st, d_sb;
    int want_num;                          // 1: write numerators; 0: numerator / normaliser
};

void run_sequences(const Problem& g, int b0, int b1) {
    const int r = g.r, dv = g.dv, dv1 = dv + 1, C = g.C;
    // aug = [S^T ; phi(K_j)]: one product gives the state read and the intra-chunk scores of chunk j
    std::vector<float> lkp(C), local(C), crow(C), f(C), R(C * dv1), P(C * C), vb(C * dv1), wv(C * dv1),
        aug((int64_t)(dv1 + C) * r), RP(C * (dv1 + C));
    float* S = aug.data();
    for (int b = b0; b < b1; ++b) {
        float* Sg = g.S + (int64_t)b * dv1 * r;
        std::memcpy(S, Sg, sizeof(float) * dv1 * r);
        float cb = g.c[b];
        for (int t0 = 0; t0 < g.L; t0 += C) {
            const int cl = std::min(C, g.L - t0), W = dv1 + cl;
            const float* pq = g.pq + ((int64_t)b * g.L + t0) * r;
            const float* pk = g.pk + ((int64_t)b * g.L + t0) * r;
            const float* lq = g.lq + (int64_t)b * g.L + t0;
            const float* lk = g.lk + (int64_t)b * g.L + t0;
            float running = -INFINITY;
            for (int p = 0; p < cl; ++p) {
                lkp[p] = lk[p] - p * g.a;
                running = std::max(running, lkp[p]);
                local[p] = running;
            }
            const float ce = std::max(cb + cl * g.a, local[cl - 1] + (cl - 1) * g.a);
            for (int p = 0; p < cl; ++p) {
                crow[p] = std::max(local[p], cb + g.a);
                f[p] = exp_nonpos(cb + g.a - crow[p]);
            }
            for (int p = 0; p < cl; ++p) {
                const float* vr = g.v + b * g.v_sb + (int64_t)(t0 + p) * g.v_st;
                const float w = exp_nonpos(lkp[p] + (cl - 1) * g.a - ce);
                for (int e = 0; e < dv; ++e) {
                    vb[p * dv1 + e] = vr[e];
                    wv[p * dv1 + e] = vr[e] * w;
                }
                vb[p * dv1 + dv] = 1.0f;
                wv[p * dv1 + dv] = w;
            }
            std::memcpy(S + (int64_t)dv1 * r, pk, sizeof(float) * cl * r);
            gemm(false, true, cl, W, r, 1.0f, pq, r, S, r, 0.0f, RP.data(), W);
            for (int p = 0; p < cl; ++p) {
                for (int e = 0; e < dv1; ++e) R[p * dv1 + e] = RP[p * W + e] * f[p];
                for (int l = 0; l < cl; ++l) {
                    const float w = exp_nonpos(std::min(lkp[l] - crow[p], 0.0f));
                    P[p * cl + l] = l <= p ? RP[p * W + dv1 + l] * w : 0.0f;
                }
            }
            gemm(false, false, cl, dv1, cl, 1.0f, P.data(), cl, vb.data(), dv1, 1.0f, R.data(), dv1);
            gemm(true, false, dv1, r, cl, 1.0f, wv.data(), dv1, pk, r, exp_nonpos(cb + cl * g.a - ce), S, r);
            cb = ce;
            for (int p = 0; p < cl; ++p) {
                float* o = g.out + b * g.o_sb + (int64_t)(t0 + p) * g.o_st;
                const float dn = R[p * dv1 + dv];
                g.den[b * g.d_sb + t0 + p] = dn;
                g.logs[b * g.d_sb + t0 + p] = lq[p] + crow[p] + p * g.a;
                if (g.want_num) {
                    for (int e = 0; e < dv; ++e) o[e] = R[p * dv1 + e];
                } else {
                    for (int e = 0; e < dv; ++e) o[e] = R[p * dv1 + e] / dn;
                }
            }
        }
        std::memcpy(Sg, S, sizeof(float) * dv1 * r);
        g.c[b] = cb;
    }
}

}  // namespace

extern "C" int kernapprox_chunked_causal(int B, int L, int r, int dv, int C, float a, const float* pq,
                                         const float* lq, const float* pk, const float* lk, const float* v,
                                         int64_t v_sb, int64_t v_st, float* S, float* c, float* out,
                                         int64_t o_sb, int64_t o_st, float* den, float* logs, int64_t d_sb,
                                         int want_num, int threads) {
    if (B < 1 || L < 1 || r < 1 || dv < 1 || C < 1) return 1;
    const Problem g{B, L, r, dv, C, a, pq, lq, pk, lk, v, v_sb, v_st, S, c, out, den, logs, o_sb, o_st, d_sb,
                    want_num};
    const int nt = std::max(1, std::min(threads, B));
#pragma omp parallel num_threads(nt)
    {
        const int i = omp_get_thread_num(), m = omp_get_num_threads();
        const int previous = MKL_Set_Num_Threads_Local(1);     // the products of one sequence run on one thread
        run_sequences(g, (int)((int64_t)B * i / m), (int)((int64_t)B * (i + 1) / m));
        MKL_Set_Num_Threads_Local(previous);
    }
    return 0;
}
