// What our NVRTC sources share (mod.rs puts it in front of each of the step's, cuda.rs in
// front of its attention kernel): integer names, the Q8_1 block size, f16 conversions (NVRTC
// has no cuda_fp16.h without include paths) and warp and block reductions in a fixed order.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// A Q8_1 block: f16 scale, f16 sum of the values it was quantized from, 32 int8.
#define Q8_1_BYTES 36

__device__ __forceinline__ u16 f32_to_f16_bits(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    return x;
}

// Sum (or maximum) over the block's `BLOCK` threads by a fixed tree: warps first, then warp 0's
// lanes over the warps' results. Every thread gets the result.
template <int BLOCK>
__device__ float block_reduce(float x, float* scratch, bool take_max) {
    x = take_max ? warp_max(x) : warp_sum(x);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    float r = scratch[0];
    for (int w = 1; w < BLOCK / 32; ++w) r = take_max ? fmaxf(r, scratch[w]) : r + scratch[w];
    return r;
}
