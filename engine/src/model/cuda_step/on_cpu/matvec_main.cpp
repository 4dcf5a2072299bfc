// The mat-vec kernels' driver on the CPU (on_cpu.rs compiles it after cuda_on_cpu.h and
// matvec.cu's source): `matvec DIR` loads DIR/weight.bin and DIR/x.bin (Q8_1 rows), runs
// each launch of DIR/launches.txt, a line each:
//   KERNEL GRID_X GRID_Y GRID_Z BLOCK_X SHARED_BYTES K N ROWS X_BLOCKS SPLIT OUT
// (a tensor-core launch of SPLIT > 1 writes parts that `duet_matvec_combine` then adds, as
// the step launches it), and writes the ROWS x N floats of each into DIR/OUT.

#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace {

using TiledFn = void (*)(const u8*, const u8*, float*, int, int, int, int);
using MmaFn = void (*)(const u8*, const u8*, float*, int, int, int, int, int, float*);
using FewFn = void (*)(const u8*, const u8*, float*, int, int, int, int, int);

struct Kernel {
    TiledFn tiled = nullptr;
    MmaFn mma = nullptr;
    FewFn few = nullptr;
};

std::map<std::string, Kernel> kernels() {
    std::map<std::string, Kernel> k;
#define TYPE_KERNELS(NAME)                                                      \
    k["duet_matvec_" #NAME].tiled = duet_matvec_##NAME;                         \
    k["duet_matvec_" #NAME "_x4"].tiled = duet_matvec_##NAME##_x4;
#define TILES(NAME, NT) k["duet_matvec_" #NAME "_mma" #NT].mma = duet_matvec_##NAME##_mma##NT;
#define ROWS(NAME, NR) k["duet_matvec_" #NAME "_few" #NR].few = duet_matvec_##NAME##_few##NR;
#define EACH_TYPE(M, ...) M(q8_0, ##__VA_ARGS__) M(q5_0, ##__VA_ARGS__) M(q4_k, ##__VA_ARGS__) M(q6_k, ##__VA_ARGS__)
    EACH_TYPE(TYPE_KERNELS)
    EACH_TYPE(TILES, 1)
#if MMA_TILES >= 2
    EACH_TYPE(TILES, 2)
#endif
#if MMA_TILES >= 4
    EACH_TYPE(TILES, 4)
#endif
#if MMA_TILES >= 8
    EACH_TYPE(TILES, 8)
#endif
#if FEW_ROWS >= 1
    EACH_TYPE(ROWS, 1)
#endif
#if FEW_ROWS >= 2
    EACH_TYPE(ROWS, 2)
#endif
#if FEW_ROWS >= 3
    EACH_TYPE(ROWS, 4)
#endif
#if FEW_ROWS >= 5
    EACH_TYPE(ROWS, 8)
#endif
    return k;
}

std::vector<char> read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) emu::fail(("cannot read " + path).c_str());
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

// A copy of `bytes` in memory that ends at an inaccessible page.
const u8* guarded(const std::vector<char>& bytes) {
    void* p = emu::alloc(bytes.size());
    std::memcpy(p, bytes.data(), bytes.size());
    return (const u8*)p;
}

// The launch the scheduler's fibers run (a kernel body takes no arguments).
struct Launch {
    Kernel kernel;
    const u8 *weight, *x;
    float *y, *partial;
    int k, n, rows, x_blocks, split;
} now;

void run_kernel() {
    const Launch& l = now;
    if (l.kernel.tiled) l.kernel.tiled(l.weight, l.x, l.y, l.k, l.n, l.rows, l.x_blocks);
    if (l.kernel.mma)
        l.kernel.mma(l.weight, l.x, l.y, l.k, l.n, l.rows, l.x_blocks, l.split, l.partial);
    if (l.kernel.few) l.kernel.few(l.weight, l.x, l.y, l.k, l.n, l.rows, l.x_blocks, l.split);
}

void run_combine() { duet_matvec_combine(now.partial, now.y, now.rows * now.n, now.split); }

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) emu::fail("usage: matvec DIR");
    const std::string dir = argv[1];
    const u8* weight = guarded(read_file(dir + "/weight.bin"));
    const u8* x = guarded(read_file(dir + "/x.bin"));
    const auto table = kernels();
    std::ifstream launches(dir + "/launches.txt");
    std::string line;
    while (std::getline(launches, line)) {
        std::istringstream in(line);
        std::string name, out;
        dim3 grid, block;
        size_t shared;
        in >> name >> grid.x >> grid.y >> grid.z >> block.x >> shared >> now.k >> now.n >>
            now.rows >> now.x_blocks >> now.split >> out;
        if (!in || table.count(name) == 0) emu::fail(("a launch I cannot read: " + line).c_str());
        now.kernel = table.at(name);
        now.weight = weight;
        now.x = x;
        const size_t outputs = (size_t)now.rows * now.n;
        now.y = (float*)emu::alloc(outputs * 4);
        const bool parts = now.kernel.mma && now.split > 1;
        now.partial = parts ? (float*)emu::alloc(now.split * outputs * 4) : nullptr;
        emu::launch(grid, block, shared, run_kernel);
        if (parts) emu::launch(dim3{(unsigned)((outputs + 255) / 256), 1, 1}, dim3{256, 1, 1}, 0, run_combine);
        std::ofstream(dir + "/" + out, std::ios::binary).write((const char*)now.y, outputs * 4);
    }
    return 0;
}
