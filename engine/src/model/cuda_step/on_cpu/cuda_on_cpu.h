// The CUDA device language as the step's kernels use it, on the CPU, so that their logic can
// be tested where no GPU is (on_cpu.rs compiles a kernel source with this header in front
// and a driver behind, with the host's C++ compiler).
//
// Each thread of a block is a fiber on one OS thread (started by ucontext on a stack of its
// own, switched by _setjmp/_longjmp), the fibers run in turn (in thread order, then the
// other way round, alternately) and the blocks one after another, so a run is
// deterministic. A fiber runs until it waits at a barrier: `__syncthreads` (the
// block's), `__syncwarp` and every shuffle or ballot (among the lanes of its mask: a warp's
// groups may each run their own), the MMA (the whole warp's). An exited thread no longer
// counts at its barriers, as on a GPU; lanes that wait for one that never comes stop the
// run ("deadlock"). `__shared__` variables are static (one block runs at a time; a block
// finds the last one's values there, where a GPU's finds whatever the memory held); dynamic
// shared memory (`DYNAMIC_SHARED`) and the driver's buffers (`emu::alloc_at`) end at an
// inaccessible page, so a write or read past their end stops the run, and start as NaN
// bytes, so a value read before it is written shows.
//
// Arithmetic is IEEE single precision as the GPU's, compiled without contraction
// (-ffp-contract=off): the `_rn` intrinsics round as theirs; `expf` and friends are the C
// library's, within an ulp or two of CUDA's.
#pragma once

// Fibers switch by _setjmp/_longjmp between stacks, which a fortified longjmp refuses.
#undef _FORTIFY_SOURCE

#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#define DUET_ON_CPU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define DYNAMIC_SHARED(T, name) T* name = (T*)emu::dynamic_shared

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3(unsigned x = 1, unsigned y = 1, unsigned z = 1) : x(x), y(y), z(z) {}
};

namespace emu {

// Threads at a barrier and the threads that still count there.
struct Barrier {
    int arrived = 0, live = 0;
    unsigned generation = 0;
};

// A warp's barriers, one for each mask its lanes have met at, and its exited lanes.
struct Warp {
    std::map<unsigned, Barrier> barriers;
    unsigned exited = 0;
};

constexpr size_t STACK_BYTES = 256 << 10;

struct Fiber {
    ucontext_t context;  // its start
    jmp_buf resume;      // where it waits
    std::unique_ptr<char[]> stack;  // STACK_BYTES, left uninitialised
    dim3 index;
    int linear = 0;  // x + y * blockDim.x + z * blockDim.x * blockDim.y
    bool done = false, started = false;
};

inline ucontext_t scheduler, start_template;
inline jmp_buf scheduler_resume;
inline std::vector<Fiber> fibers;
inline Fiber* current = nullptr;
inline Barrier block_barrier;
inline std::vector<Warp> warps;
inline std::vector<uint64_t> warp_slots;  // 32 a warp: what each lane offers a shuffle
inline dim3 block_index, block_dim, grid_dim;
inline void* dynamic_shared = nullptr;
inline void (*body)() = nullptr;
inline uint64_t progress = 0;  // arrivals, releases and exits: a round without any is stuck

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "cuda_on_cpu: %s (block %u,%u,%u)\n", what, block_index.x,
                 block_index.y, block_index.z);
    std::exit(3);
}

// `bytes` (a multiple of 8 up) ending at an inaccessible page, filled with 0xFF.
inline void* alloc(size_t bytes) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t size = (bytes + 7) / 8 * 8, pages = (size + page - 1) / page;
    char* base = (char*)mmap(nullptr, (pages + 1) * page, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED || mprotect(base + pages * page, page, PROT_NONE) != 0)
        fail("out of memory");
    char* p = base + pages * page - size;
    std::memset(p, 0xFF, size);
    return p;
}

// `bytes` (a multiple of 8 up) at address `at`, which ends at a page's end: the page after
// it inaccessible and every byte 0xFF, as `alloc`'s. The driver puts buffers where a test
// says, so that the addresses the step's launches name (and its inputs hold) are theirs.
inline void* alloc_at(size_t bytes, uint64_t at) {
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    const uint64_t size = (bytes + 7) / 8 * 8, end = at + size, base = at / page * page;
    if (end % page != 0) fail("a buffer's end is not a page's");
    void* mapped = mmap((void*)base, end - base + page, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (mapped != (void*)base || mprotect((char*)end, page, PROT_NONE) != 0)
        fail("cannot map a buffer at its address");
    std::memset((void*)at, 0xFF, size);
    return (void*)at;
}

// What `alloc(bytes)` returned, unmapped.
inline void unmap(void* p, size_t bytes) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t size = (bytes + 7) / 8 * 8, pages = (size + page - 1) / page;
    munmap((char*)p + size - pages * page, (pages + 1) * page);
}

// Back to the scheduler, to go on from here when it resumes this fiber. Switching by
// _setjmp/_longjmp, unlike swapcontext, leaves the signal mask alone: no system call.
inline void yield() {
    if (_setjmp(current->resume) == 0) _longjmp(scheduler_resume, 1);
}

inline void release(Barrier& b) {
    b.arrived = 0;
    ++b.generation;
    ++progress;
}

inline void arrive_and_wait(Barrier& b) {
    const unsigned generation = b.generation;
    ++progress;
    if (++b.arrived == b.live) return release(b);
    while (b.generation == generation) yield();
}

inline void leave(Barrier& b) {
    --b.live;
    if (b.live > 0 && b.arrived == b.live) release(b);
}

inline int lane() { return current->linear % 32; }
inline int warp() { return current->linear / 32; }

// The barrier of the calling lane's warp among the lanes of `mask` that have not exited.
inline Barrier& warp_barrier(unsigned mask) {
    if ((mask >> lane() & 1) == 0) fail("a warp operation by a lane outside its mask");
    Warp& w = warps[warp()];
    auto found = w.barriers.find(mask);
    if (found == w.barriers.end())
        found = w.barriers.emplace(mask, Barrier{0, __builtin_popcount(mask & ~w.exited), 0}).first;
    return found->second;
}

// Every lane of `mask` offers `v`; each gets what lane `from(lane)` offered (each lane
// writes its own slot alone, so groups of a warp may exchange at once).
template <class T, class From>
inline T exchange(unsigned mask, T v, From from) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits 8 bytes");
    uint64_t* slots = &warp_slots[32 * warp()];
    std::memcpy(&slots[lane()], &v, sizeof(T));
    arrive_and_wait(warp_barrier(mask));
    T r;
    std::memcpy(&r, &slots[from(lane())], sizeof(T));
    arrive_and_wait(warp_barrier(mask));
    return r;
}

inline void entry() {
    body();
    current->done = true;
    ++progress;
    leave(block_barrier);
    Warp& w = warps[warp()];
    const unsigned bit = 1u << lane();
    w.exited |= bit;
    for (auto& [mask, b] : w.barriers)
        if (mask & bit) leave(b);
    _longjmp(scheduler_resume, 1);
}

// Runs `kernel` (a function taking no arguments that calls the kernel) over the grid.
inline void launch(dim3 grid, dim3 block, size_t shared_bytes, void (*kernel)()) {
    // Warps are runs of 32 threads in x, then y, then z order; a last warp short of 32 has
    // its missing lanes exited from the start.
    const int threads = (int)(block.x * block.y * block.z), warp_count = (threads + 31) / 32;
    if (threads == 0) fail("an empty block");
    const unsigned missing = threads % 32 == 0 ? 0u : ~0u << (threads % 32);
    grid_dim = grid;
    block_dim = block;
    body = kernel;
    // Fibers (and their stacks) are kept from launch to launch: the first `threads` run.
    while ((int)fibers.size() < threads) {
        fibers.emplace_back();
        fibers.back().stack.reset(new char[STACK_BYTES]);
    }
    warp_slots.assign(32 * warp_count, 0);
    getcontext(&start_template);
    for (block_index.z = 0; block_index.z < grid.z; ++block_index.z)
        for (block_index.y = 0; block_index.y < grid.y; ++block_index.y)
            for (block_index.x = 0; block_index.x < grid.x; ++block_index.x) {
                dynamic_shared = shared_bytes > 0 ? alloc(shared_bytes) : nullptr;
                block_barrier = Barrier{0, threads, 0};
                warps.assign(warp_count, Warp{});
                warps.back().exited = missing;
                for (int t = 0; t < threads; ++t) {
                    Fiber& f = fibers[t];
                    f.done = false;
                    const unsigned u = (unsigned)t;
                    f.index = dim3{u % block.x, u / block.x % block.y, u / (block.x * block.y)};
                    f.linear = t;
                    f.started = false;
                    f.context = start_template;
                    f.context.uc_stack.ss_sp = f.stack.get();
                    f.context.uc_stack.ss_size = STACK_BYTES;
                    f.context.uc_link = &scheduler;
                    makecontext(&f.context, entry, 0);
                }
                // Rounds alternate the threads' order, so that a read another thread's
                // write should precede, with no barrier between, runs first in some of them.
                for (int live = threads, round = 0; live > 0; ++round) {
                    const uint64_t before = progress;
                    for (int i = 0; i < threads; ++i) {
                        Fiber& f = fibers[round % 2 == 0 ? i : threads - 1 - i];
                        if (f.done) continue;
                        current = &f;
                        // A fiber's first run starts it on its stack; later ones resume it
                        // where it yielded. Either comes back here by _longjmp.
                        if (_setjmp(scheduler_resume) == 0) {
                            if (f.started) _longjmp(f.resume, 1);
                            f.started = true;
                            swapcontext(&scheduler, &f.context);
                        }
                        if (f.done) --live;
                    }
                    if (live > 0 && progress == before) fail("deadlock: no thread can go on");
                }
                if (dynamic_shared != nullptr) unmap(dynamic_shared, shared_bytes);
            }
}

}  // namespace emu

#define threadIdx (emu::current->index)
#define blockIdx (emu::block_index)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::arrive_and_wait(emu::block_barrier); }
inline void __syncwarp(unsigned mask = 0xffffffff) {
    emu::arrive_and_wait(emu::warp_barrier(mask));
}

template <class T>
inline T __shfl_sync(unsigned mask, T v, int lane) {
    return emu::exchange(mask, v, [&](int) { return lane & 31; });
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    return emu::exchange(mask, v, [&](int l) { return (l ^ lane_mask) & 31; });
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width) {
    if (width != 32) emu::fail("a shuffle narrower than a warp");
    return __shfl_xor_sync(mask, v, lane_mask);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
    return emu::exchange(mask, v, [&](int l) { return l >= (int)delta ? l - (int)delta : l; });
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    uint64_t* slots = &emu::warp_slots[32 * emu::warp()];
    slots[emu::lane()] = predicate ? 1u << emu::lane() : 0u;
    emu::arrive_and_wait(emu::warp_barrier(mask));
    unsigned bits = 0;
    for (int l = 0; l < 32; ++l)
        if (mask >> l & 1) bits |= (unsigned)slots[l];
    emu::arrive_and_wait(emu::warp_barrier(mask));
    return bits;
}

[[noreturn]] inline void __trap() { emu::fail("__trap"); }

inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) {
        c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    }
    return c;
}
inline unsigned __vsub4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned byte = ((a >> (8 * i)) & 0xFF) - ((b >> (8 * i)) & 0xFF);
        r |= (byte & 0xFF) << (8 * i);
    }
    return r;
}
// Per byte, signed, saturated to [-128, 127].
inline int __vsubss4(int a, int b) {
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        int d = (int)(signed char)(a >> (8 * i)) - (int)(signed char)(b >> (8 * i));
        d = d < -128 ? -128 : d > 127 ? 127 : d;
        r |= ((unsigned)d & 0xFF) << (8 * i);
    }
    return (int)r;
}
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// One block at a time: atomics need no more than the plain operation.
template <class T>
inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T>
inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

// IEEE half precision, rounded to nearest even as `cvt.rn.f16.f32`.
inline uint16_t f32_to_f16_bits(float x) {
    _Float16 h = (_Float16)x;
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}
inline float f16_to_f32(uint16_t bits) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return (float)h;
}

namespace emu {

// `mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32` with a zero accumulator, from the PTX
// ISA's fragment layout for integer m16n8k16 (group g = lane / 4, t = lane % 4): A's 16 x 16
// int8, a0 row g's columns 4t..4t + 3, a1 row g + 8's; B's 16 x 8, b column g's rows
// 4t..4t + 3; D's 16 x 8 int32, d0 and d1 row g's columns 2t and 2t + 1, d2 and d3 row
// g + 8's.
inline void mma_m16n8k16_s8(int (&d)[4], int a0, int a1, int b) {
    uint64_t* slots = &warp_slots[32 * warp()];
    slots[lane()] = (uint64_t)(uint32_t)a0 | (uint64_t)(uint32_t)a1 << 32;
    uint64_t a[32];
    Barrier& all = warp_barrier(0xffffffff);
    arrive_and_wait(all);
    std::memcpy(a, slots, 32 * 8);
    arrive_and_wait(all);
    slots[lane()] = (uint32_t)b;
    arrive_and_wait(all);
    auto byte = [](uint64_t word, int i) { return (int)(signed char)(word >> (8 * i)); };
    auto at_a = [&](int row, int col) {  // the lane holding it, the register, the byte
        return byte(a[4 * (row % 8) + col / 4], (row / 8) * 4 + col % 4);
    };
    auto at_b = [&](int k, int col) { return byte(slots[4 * col + k / 4], k % 4); };
    const int g = lane() / 4, t = lane() % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        int sum = 0;
        for (int k = 0; k < 16; ++k) sum += at_a(row, k) * at_b(k, col);
        d[i] = sum;
    }
    arrive_and_wait(all);
}

}  // namespace emu

// What candle's mat-vec source (`mmvq_gguf.cu`, llama.cpp's mmvq) takes from cuda_fp16.h and
// cuda_bf16.h, and its launches: on_cpu.rs rewrites `kernel<<<grid, block, shared,
// stream>>>(args)` as `emu::Launcher{grid, block, shared, stream}.run(kernel, args)`.
struct half {
    _Float16 h;
    half() = default;
    half(float f) : h((_Float16)f) {}
    operator float() const { return (float)h; }
};
struct half2 {
    half x, y;
};
struct float2 {
    float x, y;
};
inline float __half2float(half a) { return (float)a.h; }
inline float2 __half22float2(half2 a) { return {(float)a.x.h, (float)a.y.h}; }
inline float __low2float(half2 a) { return (float)a.x.h; }
inline half __low2half(half2 a) { return a.x; }
// bfloat16: the top half of an f32, rounded to nearest even.
struct __nv_bfloat16 {
    uint16_t bits;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) {
        uint32_t x;
        std::memcpy(&x, &f, 4);
        bits = (uint16_t)((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
    }
    operator float() const {
        const uint32_t x = (uint32_t)bits << 16;
        float f;
        std::memcpy(&f, &x, 4);
        return f;
    }
};
inline float __bfloat162float(__nv_bfloat16 b) { return (float)b; }
typedef void* cudaStream_t;

namespace emu {

// A `kernel<<<grid, block, shared, stream>>>(args...)` launch, run at once.
struct Launcher {
    dim3 grid, block;
    size_t shared = 0;
    cudaStream_t stream = nullptr;

    template <class... P, class... A>
    void run(void (*kernel)(P...), A... args) {
        static std::function<void()> call;
        call = [=] { kernel(P(args)...); };
        launch(grid, block, shared, [] { call(); });
    }
};

}  // namespace emu
