// The kernels' driver on the CPU (on_cpu.rs compiles it after cuda_on_cpu.h and a kernel
// source): `script DIR` runs DIR/script.txt, a line each:
//   load NAME AT FILE               a buffer at address AT holding DIR/FILE
//   alloc NAME AT BYTES             a buffer at AT of BYTES, every byte 0xFF (NaN as f32)
//   zeros NAME AT BYTES             a buffer at AT of BYTES, every byte 0
//   table NAME AT REF...            a buffer at AT of u64 addresses (REF: NAME or NAME+BYTES)
//   write AT FILE                   DIR/FILE into a buffer from address AT
//   launch KERNEL GX GY GZ BX SHARED ARG...
//                                   the kernel over grid (GX, GY, GZ) of blocks of BX
//                                   threads with SHARED bytes of dynamic shared memory; each
//                                   ARG read as its parameter's type: a pointer a REF, an
//                                   address (0: none) or `null`, a number as C++ reads it
//   call FUNCTION ARG...            a host function of the source (candle's mat-vec
//                                   launchers, which launch their kernels), its arguments
//                                   read as a launch's
//   save NAME FILE                  the buffer into DIR/FILE
// Every buffer ends at an inaccessible page (emu::alloc_at).

#include <cctype>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

// A kernel's launch from its arguments' text.
using Binder = std::function<std::function<void()>(const std::vector<std::string>&)>;
// The kernels a script may launch (and host functions it may call), by name (on_cpu.rs
// writes it after this file).
std::map<std::string, Binder> duet_kernels();

namespace {

struct Buffer {
    char* data;
    size_t bytes;
};

std::map<std::string, Buffer> buffers;

[[noreturn]] void refuse(const std::string& what) { emu::fail(what.c_str()); }

// A REF's address: NAME or NAME+BYTES.
char* address(const std::string& ref) {
    const size_t plus = ref.find('+');
    const std::string name = ref.substr(0, plus);
    const size_t offset = plus == std::string::npos ? 0 : std::stoull(ref.substr(plus + 1));
    const auto found = buffers.find(name);
    if (found == buffers.end() || offset > found->second.bytes) refuse("no buffer for " + ref);
    return found->second.data + offset;
}

// Address `at`, where `bytes` lie within one buffer.
char* within(u64 at, size_t bytes) {
    for (const auto& [name, b] : buffers)
        if ((u64)b.data <= at && at + bytes <= (u64)b.data + b.bytes) return (char*)at;
    refuse("no buffer holds " + std::to_string(bytes) + " bytes at " + std::to_string(at));
}

template <class T>
T argument(const std::string& text) {
    if constexpr (std::is_pointer_v<T>) {
        if (text == "null") return nullptr;
        if (std::isdigit((unsigned char)text[0])) return (T)(uintptr_t)std::stoull(text);
        return (T)address(text);
    } else if constexpr (std::is_same_v<T, float>) {
        return std::strtof(text.c_str(), nullptr);
    } else if constexpr (std::is_same_v<T, double>) {
        return std::strtod(text.c_str(), nullptr);
    } else {
        return (T)std::stoll(text);
    }
}

template <class... P, size_t... I>
std::function<void()> bind_kernel(void (*kernel)(P...), const std::vector<std::string>& args,
                           std::index_sequence<I...>) {
    return [=] { kernel(argument<P>(args[I])...); };
}

// A launch of `kernel` with `args` read as its parameters' types.
template <class... P>
std::function<void()> bind_kernel(void (*kernel)(P...), const std::vector<std::string>& args) {
    if (args.size() != sizeof...(P)) refuse("wrong number of arguments");
    return bind_kernel(kernel, args, std::index_sequence_for<P...>{});
}

std::function<void()> current;
void run_current() { current(); }

char* alloc(const std::string& name, size_t bytes, const std::string& at) {
    if (buffers.count(name) == 1) refuse("a second buffer " + name);
    char* p = (char*)emu::alloc_at(bytes, std::stoull(at));
    buffers[name] = Buffer{p, bytes};
    return p;
}

std::vector<char> read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) refuse("cannot read " + path);
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) refuse("usage: script DIR");
    const std::string dir = argv[1];
    const auto kernels = duet_kernels();
    std::ifstream script(dir + "/script.txt");
    std::string line;
    while (std::getline(script, line)) {
        std::istringstream in(line);
        std::string op, name;
        in >> op >> name;
        std::vector<std::string> words;
        for (std::string w; in >> w;) words.push_back(w);
        if (op == "load" && words.size() == 2) {
            const std::vector<char> bytes = read_file(dir + "/" + words[1]);
            std::memcpy(alloc(name, bytes.size(), words[0]), bytes.data(), bytes.size());
        } else if (op == "alloc" && words.size() == 2) {
            alloc(name, std::stoull(words[1]), words[0]);
        } else if (op == "zeros" && words.size() == 2) {
            std::memset(alloc(name, std::stoull(words[1]), words[0]), 0, std::stoull(words[1]));
        } else if (op == "table" && !words.empty()) {
            u64* table = (u64*)alloc(name, 8 * (words.size() - 1), words[0]);
            for (size_t i = 1; i < words.size(); ++i) table[i - 1] = (u64)address(words[i]);
        } else if (op == "write" && words.size() == 1) {
            const std::vector<char> bytes = read_file(dir + "/" + words[0]);
            std::memcpy(within(std::stoull(name), bytes.size()), bytes.data(), bytes.size());
        } else if (op == "launch" && words.size() >= 5 && kernels.count(name) == 1) {
            const dim3 grid{(unsigned)std::stoul(words[0]), (unsigned)std::stoul(words[1]),
                            (unsigned)std::stoul(words[2])};
            const dim3 block{(unsigned)std::stoul(words[3]), 1, 1};
            const size_t shared = std::stoull(words[4]);
            current = kernels.at(name)(std::vector<std::string>(words.begin() + 5, words.end()));
            emu::launch(grid, block, shared, run_current);
        } else if (op == "call" && kernels.count(name) == 1) {
            kernels.at(name)(words)();
        } else if (op == "save" && words.size() == 1) {
            const Buffer& b = buffers.at(name);
            std::ofstream(dir + "/" + words[0], std::ios::binary).write(b.data, b.bytes);
        } else {
            refuse("a line I cannot run: " + line);
        }
    }
    return 0;
}
