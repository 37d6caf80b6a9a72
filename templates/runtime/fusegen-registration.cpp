// fusegen-registration.cpp: register_op, which turns an op's OpDef into the schemas
// fusegen::<name> and fusegen::<name>_backward with boxed CPU, Meta, CUDA and Autograd
// kernels (TORCH_LIBRARY fragments made at run time: one per op and dispatch key).
#include "fusegen-runtime-impl.h"

#include <torch/library.h>

#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// Internal to the runtime library: not exported beside register_op.
#pragma GCC visibility push(hidden)

namespace fusegen::rt {
namespace {

// ---------------------------------------------------------------------------------------
// Boxed kernels: one class, told which op, which of its schemas and which dispatch key.

enum class Schema { kForward, kBackward, kSampled };

class Kernel final : public c10::OperatorKernel {
 public:
  Kernel(const Op* op, Schema schema, Key key) : op_(op), schema_(schema), key_(key) {}

  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
    const bool backward = schema_ == Schema::kBackward;
    if (key_ == Key::kAutograd) {
      run_autograd(*op_, backward, handle, keys, stack);
      return;
    }
    const OpDef& def = *op_->def;
    if (!backward) {
      ForwardArgs a(def, *stack);
      std::vector<at::Tensor> out = run_forward(*op_, device(), a, schema_ == Schema::kSampled);
      torch::jit::drop(*stack, def.num_inputs + def.num_scalars);
      for (at::Tensor& t : out) stack->emplace_back(std::move(t));
    } else {
      BackwardArgs a(def, *stack);
      std::vector<at::Tensor> out = run_backward(*op_, device(), a);
      torch::jit::drop(*stack, backward_tensors(def) + def.num_backward_scalars + 1);
      stack->emplace_back(std::move(out));
    }
  }

 private:
  Device device() const {
    return key_ == Key::kCpu ? Device::kCpu : key_ == Key::kMeta ? Device::kMeta : Device::kCuda;
  }

  const Op* op_;
  Schema schema_;
  Key key_;
};

std::unordered_map<std::string, const Op*>& registry() {
  static auto* ops = new std::unordered_map<std::string, const Op*>();
  return *ops;
}

}  // namespace

std::mutex& registry_mutex() {
  static std::mutex* mutex = new std::mutex();
  return *mutex;
}

std::vector<torch::Library*>& libraries() {
  static std::vector<torch::Library*>* all = new std::vector<torch::Library*>();
  return *all;
}

const Op* find_op(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  const auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

const OpDef& cpu_kernels_of(const Op& op) {
  if (!op.def->cpu_later) return *op.def;
  if (const OpDef* whole = op.cpu.load()) return *whole;
  const bool hooked = call_hook("__cpu_kernels", op.name);
  const OpDef* whole = op.cpu.load();
  TORCH_CHECK(whole != nullptr, "fusegen::", op.name, ": its CPU kernels are built on its first "
              "CPU call, by fusegen's Python side, which ", hooked ? "did not load them" :
              "is not loaded (import fusegen)");
  return *whole;
}

bool call_hook(const char* hook, const std::string& name) {
  const auto op = c10::Dispatcher::singleton().findOp({std::string("fusegen::") + hook, ""});
  if (!op.has_value()) return false;
  torch::jit::Stack stack;
  stack.emplace_back(name);
  op->callBoxed(stack);
  return true;
}

// register_op and register_step run in a library's static initializer, where an exception
// would end the process (std::terminate): each failure is kept here instead, and the loader
// (fusegen/build/builder.py, load) reads it with fusegen_load_errors and raises it.
std::vector<std::string>& load_errors() {
  static std::vector<std::string> errors;
  return errors;
}

bool registered_or_kept(const char* name, const std::function<bool()>& registration) {
  try {
    return registration();
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    load_errors().push_back(std::string("fusegen::") + (name ? name : "?") + ": " + e.what());
    return false;
  }
}

}  // namespace fusegen::rt
#pragma GCC visibility pop

namespace fusegen {

using namespace rt;  // NOLINT: the runtime's own internals

namespace {

bool register_op_or_throw(const OpDef& def) {
  TORCH_CHECK(def.abi == kAbi, "fusegen::", def.name, ": built against fusegen-runtime.h ABI ",
              def.abi, ", but the runtime has ABI ", kAbi, "; rebuild the op");
  TORCH_CHECK(def.num_outputs >= 1 && def.num_outputs <= kMaxOutputs, "fusegen::", def.name,
              ": ", def.num_outputs, " outputs; an op has 1 to ", kMaxOutputs);
  std::lock_guard<std::mutex> lock(registry_mutex());
  // The op built whole, whose CPU kernels an op of the same name loaded before left for
  // later (OpDef::cpu_later): those are its, and nothing else is registered.
  const auto found = registry().find(def.name);
  if (found != registry().end() && found->second->def->cpu_later && !def.cpu_later &&
      std::string(found->second->def->schema) == def.schema) {
    found->second->cpu.store(&def);
    return true;
  }
  Op* op = new Op{&def,
                  def.name,
                  std::string(def.name) + "_backward",
                  "fusegen::" + std::string(def.name) + "_backward",
                  "FusedBackward(fusegen::" + std::string(def.name) + ")",
                  "FusedDoubleBackward(fusegen::" + std::string(def.name) + "_backward)",
                  std::string(def.name) + "_sampled",
                  std::nullopt,
                  std::nullopt,
                  std::nullopt};
  const char* file = "fusegen-registration.cpp";
  auto* defs =
      new torch::Library(torch::Library::FRAGMENT, "fusegen", std::nullopt, file, __LINE__);
  // An op that draws random numbers is tagged as torch's random ops are, so that
  // torch.compile and opcheck treat a call as a fresh draw, not a pure function.
  const bool random = def.num_random > 0;
  TORCH_CHECK(!random || def.sampled_schema != nullptr, "fusegen::", def.name,
              ": an op that draws random numbers needs its sampled schema");
  const std::vector<at::Tag> tags =
      random ? std::vector<at::Tag>{at::Tag::nondeterministic_seeded} : std::vector<at::Tag>{};
  defs->def(def.schema, tags);
  if (random) defs->def(def.sampled_schema, tags);
  if (op->has_backward()) defs->def(def.backward_schema);
  libraries().push_back(defs);
  registry()[op->name] = op;
  op->forward_op =
      c10::Dispatcher::singleton().findSchemaOrThrow(("fusegen::" + op->name).c_str(), "");
  if (op->has_backward()) {
    op->backward_op = c10::Dispatcher::singleton().findSchemaOrThrow(
        ("fusegen::" + op->backward_name).c_str(), "");
  }
  if (random) {
    op->sampled_op = c10::Dispatcher::singleton().findSchemaOrThrow(
        ("fusegen::" + op->sampled_name).c_str(), "");
  }
  for (const auto& [dispatch_key, key] : kKeys) {
#ifndef FUSEGEN_WITH_CUDA
    if (key == Key::kCuda) continue;  // a runtime built without CUDA
#endif
    if (key == Key::kCuda && def.forward_cuda == nullptr) continue;  // an op built without CUDA
    auto* impls = new torch::Library(torch::Library::IMPL, "fusegen", dispatch_key, file, __LINE__);
    const auto kernel = [&](Schema schema) {
      return torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(op, schema, key));
    };
    impls->impl(op->name.c_str(), kernel(Schema::kForward));
    if (op->has_backward()) impls->impl(op->backward_name.c_str(), kernel(Schema::kBackward));
    // The sampled form is what the forward's Autograd kernel calls below autograd: it has
    // no Autograd kernel of its own (its state output has no gradient).
    if (random && key != Key::kAutograd)
      impls->impl(op->sampled_name.c_str(), kernel(Schema::kSampled));
    libraries().push_back(impls);
  }
  return true;
}

}  // namespace

bool register_op(const OpDef& def) {
  return registered_or_kept(def.name, [&] { return register_op_or_throw(def); });
}

}  // namespace fusegen

// The registrations that failed since the last call, one line each (and forgets them when
// `out` is given): copies at most `size` bytes into `out`, returns the whole text's length.
extern "C" __attribute__((visibility("default"))) size_t fusegen_load_errors(char* out,
                                                                            size_t size) {
  std::lock_guard<std::mutex> lock(fusegen::rt::registry_mutex());
  std::string text;
  for (const std::string& e : fusegen::rt::load_errors()) text += e + "\n";
  if (out != nullptr && size > 0) {
    const size_t n = text.size() < size - 1 ? text.size() : size - 1;
    std::memcpy(out, text.data(), n);
    out[n] = '\0';
    fusegen::rt::load_errors().clear();
  }
  return text.size();
}
