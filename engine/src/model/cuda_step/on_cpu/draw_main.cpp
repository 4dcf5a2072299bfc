// The draw kernels' driver on the CPU (on_cpu.rs compiles it after cuda_on_cpu.h and
// kernels.cu's source): `draw DIR` loads DIR/logits.bin (f32) and runs each launch of
// DIR/launches.txt on the N logits from the AT-th, one block of GREEDY_THREADS as the step
// launches them:
//   greedy AT N OUT
//   draw AT N TEMPERATURE MIN_P TOP_K TOP_P UNIFORM EXCLUDE Q OUT
//   propose AT N TEMPERATURE MIN_P TOP_K TOP_P TAIL CAP OUT
// A draw's Q: a file of a draft distribution's ids (u32) then probabilities (f32), or `-`
// for none. DIR/OUT gets the launch's 3 floats, a proposal's then followed by CAP ids and
// CAP weights.

#include <fstream>
#include <sstream>
#include <string>

namespace {

std::vector<char> read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) emu::fail(("cannot read " + path).c_str());
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

template <class T>
T* guarded(const char* data, size_t count) {
    T* p = (T*)emu::alloc(count * sizeof(T));
    if (data != nullptr) std::memcpy(p, data, count * sizeof(T));
    return p;
}

// The launch the scheduler's fibers run (a kernel body takes no arguments).
struct Launch {
    std::string kind;
    const float* x;
    int n, top_k, exclude, q_len, cap;
    float temperature, min_p, top_p;
    double uniform_or_tail;
    const u32* q_ids;
    const float* q_probs;
    u32* ids;
    float *weights, *out;
} now;

void run_kernel() {
    const Launch& l = now;
    if (l.kind == "greedy")
        duet_greedy(l.x, l.n, l.out);
    else if (l.kind == "propose")
        duet_propose(l.x, l.n, l.temperature, l.min_p, l.top_k, l.top_p, l.uniform_or_tail, l.ids,
                     l.weights, l.cap, l.out);
    else
        duet_draw(l.x, l.n, l.temperature, l.min_p, l.top_k, l.top_p, l.uniform_or_tail, l.exclude,
                  l.q_ids, l.q_probs, l.q_len, l.out);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) emu::fail("usage: draw DIR");
    const std::string dir = argv[1];
    const std::vector<char> logits = read_file(dir + "/logits.bin");
    std::ifstream launches(dir + "/launches.txt");
    std::string line;
    while (std::getline(launches, line)) {
        std::istringstream in(line);
        std::string number, q = "-", out;
        size_t at;
        in >> now.kind >> at >> now.n;
        if (now.kind != "greedy") {
            in >> now.temperature >> now.min_p >> now.top_k >> now.top_p >> number;
            now.uniform_or_tail = std::strtod(number.c_str(), nullptr);
        }
        if (now.kind == "propose") in >> now.cap;
        if (now.kind == "draw") in >> now.exclude >> q;
        in >> out;
        if (!in) emu::fail(("a launch I cannot read: " + line).c_str());
        now.x = guarded<float>(logits.data() + at * 4, now.n);
        now.q_len = 0;
        now.q_ids = guarded<u32>(nullptr, 0);
        now.q_probs = guarded<float>(nullptr, 0);
        if (q != "-") {
            const std::vector<char> bytes = read_file(dir + "/" + q);
            now.q_len = (int)(bytes.size() / 8);
            now.q_ids = guarded<u32>(bytes.data(), now.q_len);
            now.q_probs = guarded<float>(bytes.data() + now.q_len * 4, now.q_len);
        }
        const int cap = now.kind == "propose" ? now.cap : 0;
        now.out = guarded<float>(nullptr, 3);
        now.ids = guarded<u32>(nullptr, cap);
        now.weights = guarded<float>(nullptr, cap);
        emu::launch(dim3{1, 1, 1}, dim3{GREEDY_THREADS, 1, 1}, 0, run_kernel);
        std::ofstream file(dir + "/" + out, std::ios::binary);
        file.write((const char*)now.out, 12);
        file.write((const char*)now.ids, cap * 4);
        file.write((const char*)now.weights, cap * 4);
    }
    return 0;
}
