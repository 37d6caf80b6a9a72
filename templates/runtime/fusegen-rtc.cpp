// fusegen-rtc.cpp: the NVRTC route. An op built in the process (fusegen.fuse, @fused) has
// its launchers compiled by the host compiler alone; each kernel they launch is compiled
// here, on its first launch, from the op's .cu (the very source nvcc compiles on the other
// route), with the NVRTC library torch loads for jiterator, for the device's
// architecture: one kernel of one dtype and layout kind, in a fraction of a second, where
// nvcc compiles every kernel of the op in seconds. Each cubin is kept in the op's cache
// entry (cubin/), so a later process loads it and compiles nothing.
//
// A cubin's file name hashes what its code depends on beyond the entry (whose key already
// covers the sources and the flags): the kernel's name, the options, the architecture,
// the NVRTC and driver versions. The folder and the file must be private to this user, as
// the cache's libraries must (builder.py), and a file whose length or checksum does not
// match its header is compiled again and replaced, never loaded.
#ifdef FUSEGEN_WITH_CUDA

#include "fusegen-runtime-impl.h"

#include <ATen/Context.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace fusegen {
namespace {

// The NVRTC and driver functions the route calls, from the libraries torch has loaded:
// ATen's own table of them (ATen/cuda/nvrtc_stub/ATenNVRTC.h) is not among the headers a
// torch wheel installs, so they are looked up by name (both are C APIs of stable ABI).
struct NvrtcProgram;
using Program = NvrtcProgram*;  // nvrtcProgram
using NvrtcResult = int;        // nvrtcResult: 0 is NVRTC_SUCCESS
struct Api {
  NvrtcResult (*nvrtcVersion)(int*, int*);
  NvrtcResult (*nvrtcCreateProgram)(Program*, const char*, const char*, int, const char* const*,
                                    const char* const*);
  NvrtcResult (*nvrtcDestroyProgram)(Program*);
  NvrtcResult (*nvrtcAddNameExpression)(Program, const char*);
  NvrtcResult (*nvrtcCompileProgram)(Program, int, const char* const*);
  NvrtcResult (*nvrtcGetProgramLogSize)(Program, size_t*);
  NvrtcResult (*nvrtcGetProgramLog)(Program, char*);
  NvrtcResult (*nvrtcGetLoweredName)(Program, const char*, const char**);
  NvrtcResult (*nvrtcGetCUBINSize)(Program, size_t*);
  NvrtcResult (*nvrtcGetCUBIN)(Program, char*);
  NvrtcResult (*nvrtcGetPTXSize)(Program, size_t*);
  NvrtcResult (*nvrtcGetPTX)(Program, char*);
  const char* (*nvrtcGetErrorString)(NvrtcResult);
  // Optional (NVRTC 11.2 and later): the architectures it compiles for, newest last.
  NvrtcResult (*nvrtcGetNumSupportedArchs)(int*) = nullptr;
  NvrtcResult (*nvrtcGetSupportedArchs)(int*) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void**, void**);
};

// The first of `names` that is loaded in the process, else the first that loads.
void* open_library(const std::vector<std::string>& names) {
  for (const int mode : {RTLD_NOW | RTLD_NOLOAD, RTLD_NOW}) {
    for (const std::string& name : names) {
      if (void* handle = dlopen(name.c_str(), mode)) return handle;
    }
  }
  return nullptr;
}

template <typename Function>
void find(void* library, const char* what, const char* name, Function& f) {
  f = library != nullptr ? reinterpret_cast<Function>(dlsym(library, name)) : nullptr;
  TORCH_CHECK(f != nullptr, "fusegen: the NVRTC route needs ", name, " from the ", what,
              ", which this process has not loaded (FUSEGEN_CUDA_COMPILER=nvcc builds the op's "
              "kernels with nvcc instead)");
}

template <typename Function>
void optional(void* library, const char* name, Function& f) {
  f = reinterpret_cast<Function>(dlsym(library, name));
}

const Api& api() {
  static const Api* table = [] {
    // torch loads NVRTC (libcaffe2_nvrtc, which links libnvrtc) and the driver on first use:
    // then the libraries below are found among those loaded.
    at::globalContext().getNVRTC();
    void* nvrtc = open_library({"libnvrtc.so." + std::to_string(CUDA_VERSION / 1000),
                                "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"});
    void* driver = open_library({"libcuda.so.1", "libcuda.so"});
    auto* a = new Api();
    const char* n = "NVRTC library (libnvrtc)";
    const char* d = "CUDA driver (libcuda)";
    find(nvrtc, n, "nvrtcVersion", a->nvrtcVersion);
    find(nvrtc, n, "nvrtcCreateProgram", a->nvrtcCreateProgram);
    find(nvrtc, n, "nvrtcDestroyProgram", a->nvrtcDestroyProgram);
    find(nvrtc, n, "nvrtcAddNameExpression", a->nvrtcAddNameExpression);
    find(nvrtc, n, "nvrtcCompileProgram", a->nvrtcCompileProgram);
    find(nvrtc, n, "nvrtcGetProgramLogSize", a->nvrtcGetProgramLogSize);
    find(nvrtc, n, "nvrtcGetProgramLog", a->nvrtcGetProgramLog);
    find(nvrtc, n, "nvrtcGetLoweredName", a->nvrtcGetLoweredName);
    find(nvrtc, n, "nvrtcGetCUBINSize", a->nvrtcGetCUBINSize);
    find(nvrtc, n, "nvrtcGetCUBIN", a->nvrtcGetCUBIN);
    find(nvrtc, n, "nvrtcGetPTXSize", a->nvrtcGetPTXSize);
    find(nvrtc, n, "nvrtcGetPTX", a->nvrtcGetPTX);
    find(nvrtc, n, "nvrtcGetErrorString", a->nvrtcGetErrorString);
    optional(nvrtc, "nvrtcGetNumSupportedArchs", a->nvrtcGetNumSupportedArchs);
    optional(nvrtc, "nvrtcGetSupportedArchs", a->nvrtcGetSupportedArchs);
    find(driver, d, "cuGetErrorString", a->cuGetErrorString);
    find(driver, d, "cuCtxGetCurrent", a->cuCtxGetCurrent);
    find(driver, d, "cuModuleLoadData", a->cuModuleLoadData);
    find(driver, d, "cuModuleGetFunction", a->cuModuleGetFunction);
    find(driver, d, "cuOccupancyMaxActiveBlocksPerMultiprocessor",
         a->cuOccupancyMaxActiveBlocksPerMultiprocessor);
    find(driver, d, "cuLaunchKernel", a->cuLaunchKernel);
    return a;
  }();
  return *table;
}

void check_driver(CUresult result, const char* what, const char* kernel) {
  if (result == CUDA_SUCCESS) return;
  const char* message = nullptr;
  api().cuGetErrorString(result, &message);
  TORCH_CHECK(false, "fusegen: ", what, " of the kernel ", kernel, " failed: ",
              message != nullptr ? message : "an unknown CUDA driver error");
}

// FNV-1a, 64 bits: the cubin's name and its checksum (a guard against a truncated or
// damaged file; who may write the folder is checked apart).
uint64_t fnv1a(const void* data, size_t size, uint64_t hash = 14695981039346656037ull) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

std::string hex(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

// A cubin file: this header, the kernel's lowered (mangled) name, which a cubin loaded
// from the cache needs without running NVRTC, then the cubin.
constexpr char kMagic[8] = {'F', 'G', 'C', 'U', 'B', 'I', 'N', '1'};
struct CubinHeader {
  char magic[8];
  uint64_t name_size;
  uint64_t size;      // of the name and the cubin
  uint64_t checksum;  // of the name and the cubin
};

struct Cubin {
  std::string lowered;
  std::vector<char> code;
};

// Owned by this user and not writable by group or others (a folder, or a file in it).
bool is_private(const struct stat& st) {
  return st.st_uid == geteuid() && (st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}

std::vector<char> read_file(const std::string& path, bool must_be_private) {
  std::vector<char> data;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return data;
  struct stat st;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (!must_be_private || is_private(st))) {
    data.resize(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = read(fd, data.data() + done, data.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    data.resize(done);
  }
  close(fd);
  return data;
}

// The cubin of a file written by keep_cubin, or none (an empty code) when the file is
// missing, not private, or not what its header says.
Cubin load_cubin(const std::string& folder, const std::string& path) {
  struct stat st;
  if (stat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || !is_private(st)) return {};
  const std::vector<char> file = read_file(path, true);
  CubinHeader header;
  if (file.size() < sizeof header) return {};
  std::memcpy(&header, file.data(), sizeof header);
  const char* body = file.data() + sizeof header;
  if (std::memcmp(header.magic, kMagic, sizeof kMagic) != 0 ||
      header.size != file.size() - sizeof header || header.name_size == 0 ||
      header.name_size >= header.size || header.checksum != fnv1a(body, header.size)) {
    return {};
  }
  return {std::string(body, header.name_size),
          std::vector<char>(body + header.name_size, body + header.size)};
}

// Written to a temp file in the folder and renamed over the name, so that another process
// sees the whole file or none. A cache that cannot be written (read-only) only loses the
// cubin: the next process compiles it again.
void keep_cubin(const std::string& folder, const std::string& path, const Cubin& cubin) {
  if (mkdir(folder.c_str(), 0700) != 0 && errno != EEXIST) return;
  struct stat st;
  if (stat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || !is_private(st)) return;
  std::string temp = folder + "/.cubin-XXXXXX";
  const int fd = mkstemp(temp.data());
  if (fd < 0) return;
  std::vector<char> body(cubin.lowered.begin(), cubin.lowered.end());
  body.insert(body.end(), cubin.code.begin(), cubin.code.end());
  CubinHeader header;
  std::memcpy(header.magic, kMagic, sizeof kMagic);
  header.name_size = cubin.lowered.size();
  header.size = body.size();
  header.checksum = fnv1a(body.data(), body.size());
  body.insert(body.begin(), reinterpret_cast<const char*>(&header),
              reinterpret_cast<const char*>(&header) + sizeof header);
  bool ok = true;
  size_t done = 0;
  while (ok && done < body.size()) {
    const ssize_t n = write(fd, body.data() + done, body.size() - done);
    ok = n > 0;
    if (ok) done += static_cast<size_t>(n);
  }
  ok = close(fd) == 0 && ok;
  if (!ok || rename(temp.c_str(), path.c_str()) != 0) unlink(temp.c_str());
}

// The folder of the library that holds `anchor`: the op's cache entry.
std::string library_folder(const void* anchor, const char* file) {
  Dl_info info;
  TORCH_CHECK(dladdr(anchor, &info) != 0 && info.dli_fname != nullptr,
              "fusegen: cannot find the library of the kernel source ", file);
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

struct Function {
  CUfunction function = nullptr;
  int blocks_per_sm = 0;  // asked on first use
};

struct State {
  std::mutex mutex;
  std::unordered_map<std::string, std::string> moved;  // build folder -> cache entry
  std::unordered_map<const RtcSource*, std::string> folders;
  // By source, kernel and device: the kernel by its name's address (the launchers' names
  // are built once and kept, fusegen-cuda-common.cuh), so a launch does no string work.
  std::map<std::tuple<const RtcSource*, const char*, int>, Function> functions;
  std::vector<std::string> events;                      // "compiled <kernel>", "loaded <kernel>"
  // Backward kernels compiling on threads of their own (compile_ahead), by cubin path.
  std::map<std::string, std::shared_future<Cubin>> ahead;
};

State& state() {
  static State* s = new State();  // never destroyed: kernels may run during exit
  return *s;
}

// The device's context, current on this thread (the runtime API makes the primary context
// current lazily; the driver API needs it now), as jiterator does.
void ensure_context() {
  CUcontext context = nullptr;
  check_driver(api().cuCtxGetCurrent(&context), "finding the CUDA context", "");
  if (context == nullptr) cudaFree(nullptr);
}

// The architecture NVRTC compiles for on a device of `arch` (major * 10 + minor): the
// device's own (a cubin), or, for a device newer than this NVRTC knows, the newest one it
// knows below it, as PTX, which the driver compiles for the device when it loads it (as
// jiterator does). A NVRTC that cannot list its architectures is asked for the device's.
int target_arch(int arch) {
  const Api& nv = api();
  int count = 0;
  if (nv.nvrtcGetNumSupportedArchs == nullptr || nv.nvrtcGetSupportedArchs == nullptr ||
      nv.nvrtcGetNumSupportedArchs(&count) != 0 || count <= 0) {
    return arch;
  }
  std::vector<int> archs(static_cast<size_t>(count));
  if (nv.nvrtcGetSupportedArchs(archs.data()) != 0) return arch;
  int best = 0;
  for (const int a : archs) {
    if (a == arch) return arch;
    if (a < arch && a > best) best = a;
  }
  return best > 0 ? best : arch;
}

// `ptx`: the code is PTX text (null-terminated), for the driver to compile; else a cubin.
Cubin compile(const std::string& source_path, const std::string& kernel,
              const std::vector<std::string>& options, bool ptx) {
  const std::vector<char> text = read_file(source_path, false);
  TORCH_CHECK(!text.empty(), "fusegen: cannot read the kernel source ", source_path);
  const std::string source(text.begin(), text.end());
  const Api& nv = api();
  Program program = nullptr;
  const auto check = [&](NvrtcResult result, const char* what) {
    TORCH_CHECK(result == 0, "fusegen: NVRTC ", what, " of ", kernel, " failed: ",
                nv.nvrtcGetErrorString(result));
  };
  check(nv.nvrtcCreateProgram(&program, source.c_str(), source_path.c_str(), 0, nullptr, nullptr),
        "program creation");
  std::unique_ptr<Program, void (*)(Program*)> owner(
      &program, [](Program* p) { api().nvrtcDestroyProgram(p); });
  check(nv.nvrtcAddNameExpression(program, kernel.c_str()), "naming the kernel");
  std::vector<const char*> argv;
  for (const std::string& o : options) argv.push_back(o.c_str());
  const NvrtcResult compiled =
      nv.nvrtcCompileProgram(program, static_cast<int>(argv.size()), argv.data());
  if (compiled != 0) {
    size_t size = 0;
    nv.nvrtcGetProgramLogSize(program, &size);
    std::string log(size, '\0');
    if (size > 0) nv.nvrtcGetProgramLog(program, log.data());
    TORCH_CHECK(false, "fusegen: NVRTC could not compile ", kernel, " from ", source_path, ": ",
                nv.nvrtcGetErrorString(compiled), "\n", log,
                "\n(FUSEGEN_CUDA_COMPILER=nvcc builds the op's kernels with nvcc instead)");
  }
  const char* name = nullptr;
  check(nv.nvrtcGetLoweredName(program, kernel.c_str(), &name), "lowering the kernel's name");
  Cubin cubin;
  cubin.lowered = name;
  size_t size = 0;
  if (ptx) {
    check(nv.nvrtcGetPTXSize(program, &size), "the PTX's size");
    cubin.code.resize(size);
    check(nv.nvrtcGetPTX(program, cubin.code.data()), "the PTX");
  } else {
    check(nv.nvrtcGetCUBINSize(program, &size), "the cubin's size");
    cubin.code.resize(size);
    check(nv.nvrtcGetCUBIN(program, cubin.code.data()), "the cubin");
  }
  return cubin;
}

// Where and how the kernels of `source` compile on the current device: the folder of the
// op's entry, the NVRTC options, and the identity of a cubin beside the kernel's name.
struct Target {
  std::string folder;
  std::string file;  // the kernel source, relative to the folder
  std::vector<std::string> options;
  bool ptx = false;
  std::string identity;  // what a cubin depends on besides its kernel

  std::string cubins() const { return folder + "/cubin"; }
  std::string cubin_path(const std::string& kernel) const {
    const std::string id = kernel + "\n" + identity;
    return cubins() + "/" + hex(fnv1a(id.data(), id.size())) + ".cubin";
  }
  Cubin compile_kernel(const std::string& kernel) const {
    Cubin cubin = compile(folder + "/" + file, kernel, options, ptx);
    keep_cubin(cubins(), cubin_path(kernel), cubin);
    return cubin;
  }
};

Target target_of(State& s, const RtcSource& source, int device) {
  auto folder = s.folders.find(&source);
  if (folder == s.folders.end()) {
    std::string path = library_folder(source.anchor, source.file);
    const auto moved = s.moved.find(path);
    folder = s.folders.emplace(&source, moved != s.moved.end() ? moved->second : path).first;
  }
  int arch_major = 0, arch_minor = 0, major = 0, minor = 0, driver = 0;
  cudaDeviceGetAttribute(&arch_major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&arch_minor, cudaDevAttrComputeCapabilityMinor, device);
  const int arch = target_arch(arch_major * 10 + arch_minor);
  api().nvrtcVersion(&major, &minor);
  cudaDriverGetVersion(&driver);
  Target t;
  t.folder = folder->second;
  t.file = source.file;
  t.ptx = arch != arch_major * 10 + arch_minor;
  const size_t slash = t.file.rfind('/');
  // The nvcc route's device flags (build/toolchain.py: no fast math, which both leave off
  // by default), so that both routes compute the same bits; -default-device compiles the
  // shared headers' unannotated inline functions (fusegen-half.h's) for the device.
  t.options = {
      (t.ptx ? "--gpu-architecture=compute_" : "--gpu-architecture=sm_") + std::to_string(arch),
      "-std=c++17",
      "-default-device",
      "-DFUSEGEN_WITH_CUDA",
      "-I" + t.folder + "/_runtime",
      "-I" + t.folder + "/" + (slash == std::string::npos ? "." : t.file.substr(0, slash)),
  };
  // The include folders by their flag alone, so that a cache that moved keeps its cubins.
  t.identity = std::to_string(major) + "." + std::to_string(minor) + "\n" +
               std::to_string(driver) + "\n" + t.file;
  for (const std::string& o : t.options)
    t.identity += "\n" + o.substr(0, o.rfind("-I", 0) == 0 ? 2 : o.npos);
  return t;
}

// The backward kernels a forward kernel's loop suggests, in its dtype: the same kind with
// the op's Backward functor for its Forward (dout laid out as the inputs), and after the
// contiguous kernel also the vector kernel without gathers (dout broadcast, as the
// gradient of a sum is); none for a kernel that is not a forward's.
std::vector<std::string> backwards_of(const std::string& kernel) {
  static const std::string kForward = "::Forward<", kBackward = "::Backward<";
  static const std::string kContiguous = "fusegen::contiguous_kernel<";
  const size_t at = kernel.rfind(kForward);
  if (at == std::string::npos) return {};
  const std::string same = kernel.substr(0, at) + kBackward + kernel.substr(at + kForward.size());
  std::vector<std::string> names = {same};
  // contiguous_kernel<T, kVec, F> -> vector_kernel<T, kVec, false, F>
  const size_t vec = same.find(", ", same.find(", ") + 1);
  if (same.rfind(kContiguous, 0) == 0 && vec != std::string::npos) {
    const std::string type_and_width = same.substr(kContiguous.size(), vec - kContiguous.size());
    names.push_back("fusegen::vector_kernel<" + type_and_width + ", false" + same.substr(vec));
  }
  return names;
}

// Before compiling a forward kernel whose backward will run (rt::backward_expected): the
// backward kernels it suggests compile on threads of their own, beside the forward's compile
// and while the forward runs, unless their cubins are on disk already; function() picks
// them up, so a new op's first backward waits for no compile of its own. A guess that the
// backward does not use (its loop takes another kind) costs only its thread's time.
// Before the process exits, the threads still compiling are waited for (not in a child
// forked meanwhile, which has none).
void compile_ahead(State& s, const Target& t, const std::string& kernel) {
  static std::once_flag wait_at_exit;
  for (const std::string& backward : backwards_of(kernel)) {
    const std::string path = t.cubin_path(backward);
    if (s.ahead.count(path) != 0 || access(path.c_str(), F_OK) == 0) continue;
    std::call_once(wait_at_exit, [] {
      static const pid_t owner = getpid();
      std::atexit([] {
        // A forked child has the map (and maybe a held mutex) but not the threads.
        if (getpid() != owner) return;
        std::vector<std::shared_future<Cubin>> running;
        {
          State& st = state();
          std::lock_guard<std::mutex> lock(st.mutex);
          for (const auto& entry : st.ahead) running.push_back(entry.second);
        }
        for (const auto& f : running) f.wait();
      });
    });
    s.ahead.emplace(path, std::async(std::launch::async,
                                     [t, backward] { return t.compile_kernel(backward); })
                              .share());
  }
}

// The kernel on the current device: found in this process, compiled ahead, loaded from the
// cubin cache, or compiled. Called with the state's mutex held.
Function& function(State& s, const RtcSource& source, const char* kernel) {
  const int device = c10::cuda::current_device();
  const auto key = std::make_tuple(&source, kernel, device);
  const auto found = s.functions.find(key);
  if (found != s.functions.end()) return found->second;

  const Target t = target_of(s, source, device);
  const std::string path = t.cubin_path(kernel);
  Cubin cubin;
  bool cached = false;
  const auto ahead = s.ahead.find(path);
  if (ahead != s.ahead.end()) {
    const std::shared_future<Cubin> compiling = ahead->second;
    s.ahead.erase(ahead);
    try {
      cubin = compiling.get();
    } catch (const std::exception&) {
      cubin = {};  // compiled again below, which reports the error
    }
  }
  if (cubin.code.empty()) {
    cubin = load_cubin(t.cubins(), path);
    cached = !cubin.code.empty();
  }
  if (cubin.code.empty()) {
    if (rt::backward_expected) compile_ahead(s, t, kernel);  // beside this one's compile
    cubin = t.compile_kernel(kernel);
  }
  ensure_context();
  CUmodule module = nullptr;
  check_driver(api().cuModuleLoadData(&module, cubin.code.data()), "loading", kernel);
  Function f;
  check_driver(api().cuModuleGetFunction(&f.function, module, cubin.lowered.c_str()), "finding",
               kernel);
  s.events.push_back((cached ? "loaded " : "compiled ") + std::string(kernel));
  return s.functions.emplace(key, f).first->second;
}

}  // namespace

void rtc_launch(const RtcSource& source, const char* kernel, const RtcShape& shape,
                cudaStream_t stream, void** params) {
  State& s = state();
  CUfunction f;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    f = function(s, source, kernel).function;
  }
  check_driver(api().cuLaunchKernel(f, shape.grid[0], shape.grid[1], shape.grid[2],
                                      static_cast<unsigned>(shape.threads), 1, 1,
                                      static_cast<unsigned>(shape.shared),
                                      reinterpret_cast<CUstream>(stream), params, nullptr),
               "the launch", kernel);
}

int rtc_blocks_per_sm(const RtcSource& source, const char* kernel, int threads) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  Function& f = function(s, source, kernel);
  if (f.blocks_per_sm == 0) {
    int blocks = 0;
    check_driver(
        api().cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, f.function, threads, 0),
        "the occupancy query", kernel);
    f.blocks_per_sm = blocks > 0 ? blocks : 1;
  }
  return f.blocks_per_sm;
}

int rtc_sm_count() {
  int count = 0;
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, c10::cuda::current_device());
  return count > 0 ? count : 1;
}

}  // namespace fusegen

// A library built by this process was loaded from its build folder `from` and then
// published as the cache entry `to` (fusegen/build/builder.py): its kernel sources and
// cubins are there now.
extern "C" __attribute__((visibility("default"))) void fusegen_rtc_moved(const char* from,
                                                                         const char* to) {
  fusegen::State& s = fusegen::state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.moved[from] = to;
  for (auto& entry : s.folders)
    if (entry.second == from) entry.second = to;
}

// What the NVRTC route did in this process, for tests and `fusegen bench build`: one line
// per kernel, "compiled <kernel>" or "loaded <kernel>" (from the cubin cache), in order.
// Copies at most `size` bytes into `out` and returns the length of the whole text.
extern "C" __attribute__((visibility("default"))) size_t fusegen_rtc_events(char* out,
                                                                           size_t size) {
  fusegen::State& s = fusegen::state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::string text;
  for (const std::string& e : s.events) text += e + "\n";
  if (out != nullptr && size > 0) {
    const size_t n = text.size() < size - 1 ? text.size() : size - 1;
    std::memcpy(out, text.data(), n);
    out[n] = '\0';
  }
  return text.size();
}

#endif  // FUSEGEN_WITH_CUDA
