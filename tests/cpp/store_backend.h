// A test-only c10d backend over a c10d::Store (test_replicas_pg): the two collectives
// trainsan::compare_replicas issues (allreduce MAX of one int64 tensor, allgather of one tensor)
// and nothing else, so that a test can build a real c10d::ProcessGroup of forked ranks without
// gloo (the torch wheel lacks the headers ProcessGroupGloo.hpp includes).
//
// A collective is the store: its n-th call on a rank writes the rank's tensor bytes under
// "store_backend/<n>/<rank>" and returns a StoreWork, which completes once every rank's key is
// in the store (store->check, never blocking) by combining them into the output tensors. A rank
// whose backend is destroyed (the process group released: its program left) writes
// "store_backend/gone/<rank>", so that a collective it never joined fails at once, the way
// gloo's fails when a peer closes its connection; a rank that is alive but never joins makes the
// collective time out after its timeout (AllreduceOptions::timeout). Work::wait(timeout) and an
// exception from a failed collective behave as c10d's Work: wait() rethrows the failure, and a
// finite timeout that passes first throws c10::DistBackendError.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <utility>
#include <vector>

namespace trainsan_test {

inline std::string data_key(uint64_t seq, int rank) {
  return "store_backend/" + std::to_string(seq) + "/" + std::to_string(rank);
}

inline std::string gone_key(int rank) { return "store_backend/gone/" + std::to_string(rank); }

inline std::vector<uint8_t> bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU).contiguous();
  const auto* p = static_cast<const uint8_t*>(c.const_data_ptr());
  return {p, p + c.nbytes()};
}

// A tensor shaped and typed as `like` holding `bytes` (another rank's bytes_of).
inline at::Tensor tensor_of(const std::vector<uint8_t>& bytes, const at::Tensor& like) {
  at::Tensor t = at::empty(like.sizes(), like.options().device(at::kCPU));
  TORCH_CHECK(bytes.size() == t.nbytes(), "store_backend: a rank sent ", bytes.size(),
              " bytes where ", t.nbytes(), " were expected");
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

class StoreWork final : public c10d::Work {
 public:
  // Gets every rank's bytes, in rank order, once all are in the store; fills the outputs.
  using Combine = std::function<void(const std::vector<std::vector<uint8_t>>&)>;

  StoreWork(c10::intrusive_ptr<c10d::Store> store, int rank, int size, uint64_t seq,
            c10d::OpType op, std::chrono::milliseconds timeout, Combine combine)
      : c10d::Work(rank, op),
        store_(std::move(store)),
        size_(size),
        seq_(seq),
        timeout_(timeout),
        deadline_(std::chrono::steady_clock::now() + timeout),
        combine_(std::move(combine)) {}

  bool isCompleted() override {
    poll();
    return c10d::Work::isCompleted();
  }

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!isCompleted()) {
      if (timeout != kNoTimeout && std::chrono::steady_clock::now() >= until) {
        C10_THROW_ERROR(DistBackendError, "store_backend: collective " + std::to_string(seq_) +
                                              ": Operation timed out!");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (const std::exception_ptr e = exception()) std::rethrow_exception(e);
    return true;
  }

 private:
  void poll() {
    if (done_) return;
    std::vector<std::string> keys;
    for (int r = 0; r < size_; ++r) keys.push_back(data_key(seq_, r));
    if (store_->check(keys)) {
      done_ = true;
      try {
        std::vector<std::vector<uint8_t>> all;
        for (const std::string& k : keys) all.push_back(store_->get(k));
        combine_(all);
        finish();
      } catch (...) {
        finish(std::current_exception());
      }
      return;
    }
    for (int r = 0; r < size_; ++r) {
      if (!store_->check({keys[static_cast<size_t>(r)]}) && store_->check({gone_key(r)})) {
        fail("rank " + std::to_string(r) + " left the group before joining it");
        return;
      }
    }
    if (std::chrono::steady_clock::now() >= deadline_) {
      fail("timed out after " + std::to_string(timeout_.count()) + " ms");
    }
  }

  void fail(const std::string& why) {
    done_ = true;
    try {
      C10_THROW_ERROR(DistBackendError,
                      "store_backend: collective " + std::to_string(seq_) + " failed: " + why);
    } catch (...) {
      finish(std::current_exception());
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int size_;
  uint64_t seq_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point deadline_;
  Combine combine_;
  bool done_ = false;  // completed or failed (polled from one thread: the training's)
};

class StoreBackend final : public c10d::Backend {
 public:
  StoreBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size)
      : c10d::Backend(rank, size), store_(std::move(store)) {}

  ~StoreBackend() override {
    try {
      store_->set(gone_key(rank_), std::vector<uint8_t>{1});
    } catch (...) {  // the store is gone too: nobody is left to tell
    }
  }

  const std::string getBackendName() const override { return "trainsan_test_store"; }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override {
    TORCH_CHECK(tensors.size() == 1, "store_backend: allreduce of one tensor only");
    c10d::ReduceOp op = opts.reduceOp;
    TORCH_CHECK(op == c10d::ReduceOp::MAX || op == c10d::ReduceOp::MIN || op == c10d::ReduceOp::SUM,
                "store_backend: allreduce supports MAX, MIN and SUM");
    const c10d::ReduceOp::RedOpType kind = op.op_;
    at::Tensor t = tensors[0];
    return post(c10d::OpType::ALLREDUCE, t, opts.timeout, [t, kind](const auto& all) {
      at::Tensor acc = tensor_of(all[0], t);
      for (size_t r = 1; r < all.size(); ++r) {
        const at::Tensor x = tensor_of(all[r], t);
        acc = kind == c10d::ReduceOp::MAX   ? at::maximum(acc, x)
              : kind == c10d::ReduceOp::MIN ? at::minimum(acc, x)
                                            : acc + x;
      }
      t.copy_(acc);
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override {
    TORCH_CHECK(inputs.size() == 1 && outputs.size() == 1 &&
                    outputs[0].size() == static_cast<size_t>(size_),
                "store_backend: allgather of one tensor into one per rank only");
    at::Tensor in = inputs[0];
    std::vector<at::Tensor> out = outputs[0];
    return post(c10d::OpType::ALLGATHER, in, opts.timeout, [in, out](const auto& all) {
      for (size_t r = 0; r < all.size(); ++r) out[r].copy_(tensor_of(all[r], in));
    });
  }

 private:
  c10::intrusive_ptr<c10d::Work> post(c10d::OpType op, const at::Tensor& t,
                                      std::chrono::milliseconds timeout,
                                      StoreWork::Combine combine) {
    if (timeout <= std::chrono::milliseconds(0)) timeout = store_->getTimeout();
    const uint64_t seq = seq_++;
    store_->set(data_key(seq, rank_), bytes_of(t));
    return c10::make_intrusive<StoreWork>(store_, rank_, size_, seq, op, timeout,
                                          std::move(combine));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  uint64_t seq_ = 0;  // collectives issued: every rank issues the same sequence
};

// A process group of `size` ranks over `store` whose CPU backend is a StoreBackend.
inline c10::intrusive_ptr<c10d::ProcessGroup> store_group(c10::intrusive_ptr<c10d::Store> store,
                                                          int rank, int size) {
  auto backend = c10::make_intrusive<StoreBackend>(store, rank, size);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  return pg;
}

}  // namespace trainsan_test
