// A CUDA twin of markbase's one-token 4-bit GEMV (wgsl/gemv.wgsl, the half-block path), to
// measure what the hardware gives the same algorithm outside Vulkan, with nvcc's register counts
// and Nsight Compute's counters (which do not see Vulkan dispatches). Not part of the build.
//
//   nvcc -O3 -arch=sm_90 -Xptxas -v [-DR=8 -DWG=256 -DABL=.. -DSB=1 ..] -o twin tools/gemv_twin.cu
//   ./twin [N K]      (default 15360 3840: 32 distinct weights, median of 20 rounds)
//
// Kernels: `stream` (the bytes alone: 4 x 16-byte loads per invocation), `gemv_half` (a
// workgroup of WG owns R rows, invocation hb takes half block hb: 16 elements, one 8-byte load
// per row), `gemv_warp` (a subgroup per R rows, no workgroup reduction).
// Switches, in the step both GEMV kernels share (bit 8 of ABL: gemv_half only): ABL (bits:
// 1 no nibble decode, 2 constant activations, 4 no scales or biases, 8 no reduction; wrong
// results, the timing of the rest), SB (scale and bias of a group in one word), ONEP (the
// decode's or-constant from a parameter: one and-or per nibble instead of two), XCO
// (activations read coalesced, wrong results), SB2 (the R rows' scale/bias words side by side:
// R / 4 16-byte loads), WT (the R rows' half blocks side by side: R / 2 16-byte loads).
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

#ifndef R
#define R 8
#endif
#ifndef WG
#define WG 256
#endif
#ifndef ABL
#define ABL 0
#endif
#ifndef SB
#define SB 0
#endif
#ifndef ONEP
#define ONEP 0
#endif
#ifndef XCO
#define XCO 0
#endif
#ifndef SB2
#define SB2 0
#endif
#ifndef WT
#define WT 0
#endif

__device__ __forceinline__ float bf(uint16_t h) { return __uint_as_float(((uint32_t)h) << 16); }

__device__ __forceinline__ float dot16(uint2 w, float4 a, float4 b, float4 c, float4 d, uint32_t one = 0x3f800000u) {
    // nibble n at bit 4i -> mantissa bits 19..22: 1 + n/16
    const uint32_t mk = 0x00780000u;
    float4 v0 = make_float4(__uint_as_float(((w.x << 19) & mk) | one), __uint_as_float(((w.x << 15) & mk) | one),
                            __uint_as_float(((w.x << 11) & mk) | one), __uint_as_float(((w.x << 7) & mk) | one));
    uint32_t u = w.x >> 16;
    float4 v1 = make_float4(__uint_as_float(((u << 19) & mk) | one), __uint_as_float(((u << 15) & mk) | one),
                            __uint_as_float(((u << 11) & mk) | one), __uint_as_float(((u << 7) & mk) | one));
    float4 v2 = make_float4(__uint_as_float(((w.y << 19) & mk) | one), __uint_as_float(((w.y << 15) & mk) | one),
                            __uint_as_float(((w.y << 11) & mk) | one), __uint_as_float(((w.y << 7) & mk) | one));
    u = w.y >> 16;
    float4 v3 = make_float4(__uint_as_float(((u << 19) & mk) | one), __uint_as_float(((u << 15) & mk) | one),
                            __uint_as_float(((u << 11) & mk) | one), __uint_as_float(((u << 7) & mk) | one));
    float4 s;
    s.x = v0.x * a.x; s.y = v0.y * a.y; s.z = v0.z * a.z; s.w = v0.w * a.w;
    s.x = fmaf(v1.x, b.x, s.x); s.y = fmaf(v1.y, b.y, s.y); s.z = fmaf(v1.z, b.z, s.z); s.w = fmaf(v1.w, b.w, s.w);
    s.x = fmaf(v2.x, c.x, s.x); s.y = fmaf(v2.y, c.y, s.y); s.z = fmaf(v2.z, c.z, s.z); s.w = fmaf(v2.w, c.w, s.w);
    s.x = fmaf(v3.x, d.x, s.x); s.y = fmaf(v3.y, d.y, s.y); s.z = fmaf(v3.z, d.z, s.z); s.w = fmaf(v3.w, d.w, s.w);
    return (s.x + s.y) + (s.z + s.w);
}

// One step of an invocation: half block hb of rows r0 .. r0 + R - 1, added to acc.
__device__ __forceinline__ void half_step(float* acc, int hb, int r0, const uint2* __restrict__ wq,
                                          const uint16_t* __restrict__ sc, const uint16_t* __restrict__ bi,
                                          const float4* __restrict__ x, int N, int K, uint32_t onep) {
    int nb = K / 32;
    int blk = hb >> 1, h = hb & 1;
    int xb = blk * 8 + 4 * h;
#if ABL & 2
    float4 a = make_float4(hb, hb + 1, hb + 2, hb + 3), b = a, c = a, d = a;
#else
#if XCO
    int xc = (hb & ~31) * 4 + (hb & 31);
    float4 a = x[xc], b = x[xc + 32], c = x[xc + 64], d = x[xc + 96];
#else
    float4 a = x[xb], b = x[xb + 1], c = x[xb + 2], d = x[xb + 3];
#endif
#endif
    float xs = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w)) + ((c.x + c.y) + (c.z + c.w)) + ((d.x + d.y) + (d.z + d.w));
#if SB2
    // scale/bias pairs tiled [N/8][K/64][8]: the R rows' pairs of this group in R/4 16-byte loads
    uint32_t sbt[R];
    {
        const uint4* t = (const uint4*)sc + ((size_t)(r0 / 8) * (K / 64) + blk / 2) * 2;
#pragma unroll
        for (int q = 0; q < R / 4; q++) { uint4 v = t[q]; sbt[4 * q] = v.x; sbt[4 * q + 1] = v.y; sbt[4 * q + 2] = v.z; sbt[4 * q + 3] = v.w; }
    }
#endif
#if WT
    // weights tiled [N/8][2*nb][8 rows][8 bytes]: the R rows' half blocks in R/2 16-byte loads
    uint2 wt[R];
    {
        const uint4* t = (const uint4*)wq + ((size_t)(r0 / 8) * (2 * nb) + hb) * 4;
#pragma unroll
        for (int q = 0; q < R / 2; q++) { uint4 v = t[q]; wt[2 * q] = make_uint2(v.x, v.y); wt[2 * q + 1] = make_uint2(v.z, v.w); }
    }
#endif
#pragma unroll
    for (int r = 0; r < R; r++) {
        int row = min(r0 + r, N - 1);
#if WT
        uint2 w = wt[r];
#else
        uint2 w = wq[(row * nb + blk) * 2 + h];
#endif
        int g = row * (K / 64) + blk / 2;
#if ABL & 4
        float s = 1.0f, bb = 0.5f;
#elif SB2
        uint32_t sbv = sbt[r];
        float s = __uint_as_float(sbv << 16), bb = __uint_as_float(sbv & 0xffff0000u);
#elif SB
        uint32_t sbv = ((const uint32_t*)sc)[g];
        float s = __uint_as_float(sbv << 16), bb = __uint_as_float(sbv & 0xffff0000u);
#else
        float s = bf(sc[g]), bb = bf(bi[g]);
#endif
#if ABL & 1
        float dd = __uint_as_float(w.x) * a.x + __uint_as_float(w.y) * b.y;
#else
#if ONEP
        float dd = dot16(w, a, b, c, d, onep);
#else
        float dd = dot16(w, a, b, c, d);
#endif
#endif
        acc[r] += 16.f * s * dd + (bb - 16.f * s) * xs;
    }
}

// The WGSL kernel's shape: workgroup of WG owns R rows; invocation hb takes half block hb.
__global__ void __launch_bounds__(WG) gemv_half(const uint2* __restrict__ wq, const uint16_t* __restrict__ sc,
                                                const uint16_t* __restrict__ bi, const float4* __restrict__ x,
                                                float* __restrict__ y, int N, int K, uint32_t onep) {
    __shared__ float red[(WG / 32) * R];
    int r0 = blockIdx.x * R;
    int nb = K / 32;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (int hb = threadIdx.x; hb < 2 * nb; hb += WG) {
        half_step(acc, hb, r0, wq, sc, bi, x, N, K, onep);
    }
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#if ABL & 8
    float t8 = 0.f;
#pragma unroll
    for (int r = 0; r < R; r++) t8 += acc[r];
    if (t8 == 1234.5f) y[threadIdx.x] = t8;
    return;
#endif
#pragma unroll
    for (int r = 0; r < R; r++) {
        float v = acc[r];
        for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
        if (lane == 0) red[wid * R + r] = v;
    }
    __syncthreads();
    if (threadIdx.x < R && r0 + threadIdx.x < N) {
        float t = 0.f;
        for (int j = 0; j < WG / 32; j++) t += red[j * R + threadIdx.x];
        y[r0 + threadIdx.x] = t;
    }
}

// One warp per R rows, no block-level reduction; lanes walk the half blocks.
__global__ void __launch_bounds__(WG) gemv_warp(const uint2* __restrict__ wq, const uint16_t* __restrict__ sc,
                                                const uint16_t* __restrict__ bi, const float4* __restrict__ x,
                                                float* __restrict__ y, int N, int K) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int r0 = (blockIdx.x * (WG / 32) + wid) * R;
    if (r0 >= N) return;
    int nb = K / 32;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (int hb = lane; hb < 2 * nb; hb += 32) {
        half_step(acc, hb, r0, wq, sc, bi, x, N, K, 0x3f800000u);
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float v = acc[r];
        for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
        if (lane == 0 && r0 + r < N) y[r0 + r] = v;
    }
}

__global__ void stream(const uint4* __restrict__ w, uint32_t* out, size_t n) {
    size_t base = (size_t)blockIdx.x * 256 * 4 + threadIdx.x;
    uint32_t a = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        size_t j = base + i * 256;
        if (j < n) { uint4 v = w[j]; a ^= v.x ^ v.y ^ v.z ^ v.w; }
    }
    if (a == 0x12345678u) out[blockIdx.x] = a;
}

int main(int argc, char** argv) {
    int N = argc > 1 ? atoi(argv[1]) : 15360, K = argc > 2 ? atoi(argv[2]) : 3840;
    int L = 32, iters = 20;
    size_t wbytes = (size_t)N * K / 2, sbytes = (size_t)N * (K / 64) * 4;
    std::vector<uint8_t*> W(L), S(L), B(L);
    for (int l = 0; l < L; l++) {
        CK(cudaMalloc(&W[l], wbytes)); CK(cudaMalloc(&S[l], sbytes)); CK(cudaMalloc(&B[l], sbytes));
        CK(cudaMemset(W[l], 0x5a + l, wbytes)); CK(cudaMemset(S[l], 0x3c, sbytes)); CK(cudaMemset(B[l], 0x3b, sbytes));
    }
    float *x, *y; uint32_t* o;
    CK(cudaMalloc(&x, K * 8)); CK(cudaMalloc(&y, N * 4)); CK(cudaMalloc(&o, 1 << 20));
    CK(cudaMemset(x, 0, K * 4));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    double bytes = wbytes + sbytes;
    for (int v = 0; v < 3; v++) {
        std::vector<float> ts;
        for (int it = 0; it < iters + 2; it++) {
            cudaEventRecord(e0);
            for (int l = 0; l < L; l++) {
                if (v == 0) stream<<<(unsigned)((wbytes / 16 + 1023) / 1024), 256>>>((const uint4*)W[l], o, wbytes / 16);
                else if (v == 1) gemv_half<<<(N + R - 1) / R, WG>>>((const uint2*)W[l], (const uint16_t*)S[l], (const uint16_t*)B[l], (const float4*)x, y, N, K, 0x3f800000u);
                else gemv_warp<<<(N + R * (WG / 32) - 1) / (R * (WG / 32)), WG>>>((const uint2*)W[l], (const uint16_t*)S[l], (const uint16_t*)B[l], (const float4*)x, y, N, K);
            }
            cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
            float ms; cudaEventElapsedTime(&ms, e0, e1);
            if (it >= 2) ts.push_back(ms);
        }
        std::sort(ts.begin(), ts.end());
        double us = ts[ts.size() / 2] * 1000.0 / L;
        const char* nm[] = {"stream", "gemv_half", "gemv_warp"};
        double b = v == 0 ? (double)wbytes : bytes;
        printf("TWIN SB2=%d WT=%d SB=%d ONEP=%d XCO=%d %s R=%d WG=%d N=%d K=%d: %.2f us/layer, %.0f GB/s\n", SB2, WT, SB, ONEP, XCO, nm[v], R, WG, N, K, us, b / us / 1e3);
    }
    CK(cudaGetLastError());
    return 0;
}
