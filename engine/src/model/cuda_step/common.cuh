// What our NVRTC sources share (mod.rs puts it in front of each of the step's, cuda.rs in
// front of its attention kernel): integer names, the Q8_1 block size, f16 conversions (NVRTC
// has no cuda_fp16.h without include paths) and warp and block reductions in a fixed order.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// A Q8_1 block: f16 scale, f16 sum of the values it was quantized from, 32 int8.
#define Q8_1_BYTES 36

// (On the CPU, cuda_on_cpu.h has its own: a test's host build has no PTX.)
#ifndef DUET_ON_CPU
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
#endif

// Dynamic shared memory, as a macro that the CPU's build stands in for.
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

// A warp's sum by a fixed butterfly (floats, doubles, ints).
template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    return x;
}

// Sum over the block's `BLOCK` threads by a fixed tree (floats, doubles, ints): warps first,
// then each thread over the warps' results in warp order. Every thread gets the result.
template <int BLOCK, typename T>
__device__ T block_sum(T x, T* scratch) {
    x = warp_sum(x);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
    __syncthreads();
    T r = scratch[0];
    for (int w = 1; w < BLOCK / 32; ++w) r += scratch[w];
    return r;
}

// Sum (or maximum) over the block's `BLOCK` threads, as block_sum adds.
template <int BLOCK>
__device__ float block_reduce(float x, float* scratch, bool take_max) {
    if (!take_max) return block_sum<BLOCK>(x, scratch);
    x = warp_max(x);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
    __syncthreads();
    float r = scratch[0];
    for (int w = 1; w < BLOCK / 32; ++w) r = fmaxf(r, scratch[w]);
    return r;
}
