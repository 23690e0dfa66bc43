// A pool of large host blocks for the big outputs of the native CPU kernels (the MoE's
// pre-activations, outputs and weight gradients).
//
// A fresh multi-megabyte allocation from glibc is mapped for the call and unmapped when
// freed (above its mmap threshold, 32 MiB at most), so every call first-touches all of it:
// one page fault and one zeroed page per 4 KiB. At the MoE backward's gradients that cost as
// much as a good part of the GEMMs (at the cpu-target shape, ~60 MB of fresh memory a call).
// Blocks of at least kMinBytes come from here instead: when a tensor on one is freed, the
// block is kept (up to a cap on what the pool holds unused) and handed to the next request
// of the same rounded size, already mapped. The pool never holds a block something still
// uses: a block is returned by the storage's deleter, so a tensor autograd keeps, a .grad it
// became, or a view of it keeps its block out of the pool. Smaller requests, and all of them
// with the pool off, go to the default CPU allocator.
//
// SMELT_CPU_POOL_MB (read on every allocation): the most megabytes kept unused, default
// 1024; 0 turns the pool off. smelt_cpu::pool_release() frees what it holds;
// smelt_cpu::pool_stats() reports it.
#pragma once

#include <ATen/ATen.h>
#include "env.h"
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

namespace smelt {

class BlockPool final : public c10::Allocator {
 public:
  static constexpr size_t kMinBytes = size_t(4) << 20;  // smaller: the default allocator
  static constexpr size_t kGranule = size_t(2) << 20;   // block sizes are multiples of this

  // Never destroyed: deleters of tensors that outlive static destruction still find it.
  static BlockPool& get() {
    static BlockPool* pool = new BlockPool();
    return *pool;
  }

  // Most bytes kept unused: SMELT_CPU_POOL_MB, default 1024 MiB.
  static size_t cap() {
    const std::string value = smelt::env("SMELT_CPU_POOL_MB");
    const char* v = value.c_str();
    if (v[0] == '\0') return size_t(1024) << 20;
    char* end = nullptr;
    const long long mb = std::strtoll(v, &end, 10);
    return (end == v || mb <= 0) ? 0 : static_cast<size_t>(mb) << 20;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes || cap() == 0) return c10::GetCPUAllocator()->allocate(n);
    const size_t size = (n + kGranule - 1) / kGranule * kGranule;
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        held_ -= size;
        ++reused_;
      } else {
        ++fresh_;
      }
    }
    if (p == nullptr) p = fresh_block(size);
    return {p, new Block{p, size}, &BlockPool::give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // A new block of `size` bytes. When memory is short, the unused blocks the pool holds are
  // freed and the allocation tried once more; then torch.OutOfMemoryError with the bytes.
  void* fresh_block(size_t size) {
    try {
      return c10::alloc_cpu(size);
    } catch (const c10::Error&) {
    }
    if (release() > 0) {
      try {
        return c10::alloc_cpu(size);
      } catch (const c10::Error&) {
      }
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory: could not allocate ", size,
                     " bytes for a pooled output block");
  }

  // Frees every block the pool holds; returns the bytes freed.
  int64_t release() {
    std::map<size_t, std::vector<void*>> blocks;
    size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      bytes = held_;
      held_ = 0;
    }
    for (auto& [size, ptrs] : blocks)
      for (void* p : ptrs) c10::free_cpu(p);
    return static_cast<int64_t>(bytes);
  }

  // (bytes held unused, blocks handed out again, blocks freshly allocated)
  std::tuple<int64_t, int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {static_cast<int64_t>(held_), reused_, fresh_};
  }

 private:
  struct Block {
    void* ptr;
    size_t size;
  };

  static void give_back(void* ctx) {
    Block* b = static_cast<Block*>(ctx);
    get().keep(b->ptr, b->size);
    delete b;
  }

  void keep(void* p, size_t size) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (held_ + size <= cap()) {
        free_[size].push_back(p);
        held_ += size;
        return;
      }
    }
    c10::free_cpu(p);
  }

  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // unused blocks by size
  size_t held_ = 0;
  int64_t reused_ = 0, fresh_ = 0;
};

// A contiguous CPU tensor on a pooled block (at::empty's layout and dtype).
inline at::Tensor pooled_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_generic(sizes, &BlockPool::get(), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                   std::nullopt);
}

}  // namespace smelt
