// What the step's NVRTC sources share (mod.rs puts it in front of each): integer names,
// the Q8_1 block size, f16 conversions (NVRTC has no cuda_fp16.h without include paths) and
// warp reductions in a fixed butterfly order.

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
