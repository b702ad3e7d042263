// rank_desync for a LibTorch program: the replica comparison over a c10d process group
// (trainsan::compare_replicas, trainsan/replicas.h).
//
// Note [Replica comparison over c10d]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The C++ twin of bindings/trainsan/replicas.py (Note [Replica comparison]) for one replica set:
// the caller's group, whose every rank holds a replica of every parameter of the sanitizer (a
// data-parallel program). Per step event of an optimizer (the step pass, or a step its
// scaler skipped) every rank builds its row (trainsan::replica_row, Note [Replica payload]) from
// the pass's fingerprints (Sanitizer::take_fingerprints' StepFingerprints), all-reduces (MAX)
// [row, ~row] on the group, and reads the result at its next event (or at close()), so the
// training does not wait for it; the verdict is trainsan::judge_replica_payload. Where something
// differs, an all-gather of the rows on the same group tells which ranks hold which value (Python
// asks the store instead; the schedule of collectives depends only on the sequence of events, so
// every rank issues the gather at the same place in its sequence). Differences from Python: the
// weights replicas start from are compared when compare_replicas() is called (before the loop,
// not at the first optimizer step); the optimizer state's slot stays empty (a
// torch::optim::Optimizer's state is not readable generically); the ranks are the group's own
// (0..size-1); a rank that does not arrive within desync_timeout is reported as the other ranks
// of the group (no store exchange says which closed early).
//
// A comparison that does not complete within desync_timeout seconds (polled: Work::isCompleted)
// or fails (a peer left) reports the missing ranks (ReplicaReport::kMissing) and ends the
// comparison; the Work stays referenced here until the sanitizer goes. A failure of the
// comparison's own machinery stops it with a warning on stderr, never reaching the training.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "checks/replicas.h"
#include "feeds/replica_feed.h"
#include "trainsan/replicas.h"

namespace trainsan {
namespace host {

struct ReplicaAccess {
  static SanitizerImpl& impl(Sanitizer& san) { return *san.impl_; }
  static void report(Sanitizer& san) { san.report(); }  // the policy's answer to new findings
};

namespace {

// An error's message for a finding: a c10::Error without its C++ backtrace.
std::string brief(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

using Clock = std::chrono::steady_clock;

uint64_t fold(uint64_t h, const std::string& s) {
  for (const unsigned char c : s) h = (h ^ c) * 0x100000001B3ULL;
  return (h ^ 0xFF) * 0x100000001B3ULL;  // a separator, so ("ab","c") != ("a","bc")
}

std::string layout_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << ' ' << t.scalar_type();
  return os.str();
}

at::Tensor to_tensor(const std::vector<int64_t>& v) {
  return at::tensor(c10::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong)).clone();
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  const int64_t* d = c.const_data_ptr<int64_t>();
  return {d, d + c.numel()};
}

class PgReplicaDriver final : public ReplicaFeed::Driver {
 public:
  PgReplicaDriver(ReplicaFeed& feed, c10::intrusive_ptr<c10d::ProcessGroup> group,
                  ReplicaSetup setup)
      : feed_(feed), ctx_(feed.context()), group_(std::move(group)), setup_(std::move(setup)) {
    if (setup_.name.empty()) {
      setup_.name = "the data-parallel group (the process group given to compare_replicas)";
    }
    for (int r = 0; r < group_->getSize(); ++r) ranks_.push_back(r);
    uint64_t h = fold(0xCBF29CE484222325ULL, setup_.name + "/" + std::to_string(ranks_.size()));
    for (size_t i = 0; i < ctx_.params.size(); ++i) {
      members_.push_back(static_cast<int64_t>(i));
      names_.push_back(ctx_.params[i].name);
      h = fold(fold(h, ctx_.params[i].name), layout_of(ctx_.params[i].data()));
    }
    if (ctx_.opts.desync_buffers) {
      for (const auto& [name, t] : setup_.buffers) {
        if (!t.defined()) continue;
        buffer_names_.push_back(name);
        buffers_.push_back(t);
        h = fold(fold(h, "buffer " + name), layout_of(t));
      }
    }
    digest_ = static_cast<int64_t>(h);
    timeout_ = std::chrono::duration<double>(ctx_.opts.desync_timeout);
  }

  // The weights the replicas start from: one blocking comparison.
  void first() {
    guarded([&] {
      Event ev;
      ev.forwards = ctx_.coverage.training_forwards;
      ev.waiting = false;
      ev.first = true;
      std::vector<at::Tensor> ts;
      for (const TrackedParam& p : ctx_.params) ts.push_back(p.data().detach());
      const std::vector<TensorStats> stats = tensor_stats(ts);
      for (size_t i = 0; i < stats.size(); ++i) {
        ev.fingerprints.index.push_back(static_cast<int64_t>(i));
        ev.fingerprints.param.push_back(static_cast<int64_t>(stats[i].hash));
        ev.fingerprints.grad.push_back(0);
        ev.fingerprints.has_grad.push_back(false);
      }
      launch(ev);
      drain(0);
    });
  }

  void on_event(int64_t opt, bool skipped) override {
    if (dead_) return;
    guarded([&] {
      Event ev;
      ev.opt = opt;
      ev.count = events_[opt]++;
      ev.step = steps_[opt];
      if (!skipped) steps_[opt] += 1;
      ev.skipped = skipped;
      ev.forwards = ctx_.coverage.training_forwards;
      ev.waiting = !skipped && feed_.enabled && ctx_.checks.replicas.fingerprint_due(ev.step);
      const bool sampled = !skipped && ctx_.checks.replicas.grads_due(ev.step);
      if (ev.waiting && sampled && setup_.grads) ev.grads = members_;
      if (sampled && !buffers_.empty()) {
        std::vector<at::Tensor> ts;
        for (const at::Tensor& b : buffers_) ts.push_back(b.detach());
        for (const TensorStats& s : tensor_stats(ts)) {
          ev.buffers.push_back(static_cast<int64_t>(s.hash));
        }
      }
      fifo_.push_back(std::move(ev));
      pump(false);
    });
  }

  void finish() override {
    if (!dead_) guarded([&] { pump(true); });
  }

 private:
  struct Event : ReplicaRowFacts {
    bool waiting = true;  // its pass's fingerprints have not landed yet
    bool first = false;   // before the first step
  };
  struct InFlight {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor payload;
    std::vector<int64_t> row;
    Event ev;
  };

  template <typename F>
  void guarded(F&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      give_up(std::string("its comparison failed: ") + brief(e));
    }
  }

  void give_up(const std::string& why) {
    if (dead_) return;
    dead_ = true;
    std::cerr << "trainsan: rank_desync stops comparing " << setup_.name << ": " << why << "\n";
  }

  // Attach landed fingerprints to their events, launch the comparisons that are ready and read
  // those launched before the newest (all of them when `final`).
  void pump(bool final) {
    std::vector<StepFingerprints> landed;
    landed.swap(feed_.fingerprints);
    for (StepFingerprints& fp : landed) {
      for (Event& ev : fifo_) {
        if (ev.opt != fp.opt || ev.skipped || !ev.waiting) continue;
        if (ev.step == fp.step) {
          ev.fingerprints = std::move(fp);
          ev.waiting = false;
          break;
        }
        if (ev.step < fp.step) ev.waiting = false;  // its pass was never checked
      }
    }
    while (!fifo_.empty() && (!fifo_.front().waiting || final) && !dead_) {
      launch(fifo_.front());
      fifo_.pop_front();
    }
    drain(final ? 0 : 1);
  }

  void launch(Event ev) {
    ev.digest = digest_;
    std::vector<int64_t> row = replica_row(ev, members_, buffers_.size());
    std::vector<int64_t> both = row;
    for (const int64_t x : row) both.push_back(~x);
    std::vector<at::Tensor> payload{to_tensor(both)};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    o.timeout = collective_timeout();
    auto work = group_->allreduce(payload, o);
    in_flight_.push_back({std::move(work), payload[0], std::move(row), std::move(ev)});
  }

  // The collective's own timeout: past desync_timeout (which wait() polls, so that a missing
  // rank is reported as such), and finite, so that a collective given up on ends by itself.
  std::chrono::milliseconds collective_timeout() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(2 * timeout_) +
           std::chrono::milliseconds(1000);
  }

  // Waits for `work` up to desync_timeout. "" when it completed, else why not (`timed_out`).
  std::string wait(const c10::intrusive_ptr<c10d::Work>& work, bool& timed_out, double& waited) {
    const auto t0 = Clock::now();
    timed_out = false;
    while (!work->isCompleted()) {
      const auto spent = Clock::now() - t0;
      if (spent >= timeout_) {
        timed_out = true;
        waited = timeout_.count();
        return "it did not complete";
      }
      std::this_thread::sleep_for(spent < std::chrono::milliseconds(10)
                                      ? std::chrono::microseconds(200)
                                      : std::chrono::microseconds(5000));
    }
    waited = std::chrono::duration<double>(Clock::now() - t0).count();
    try {
      work->wait();
    } catch (const std::exception& e) {
      return brief(e);
    }
    return "";
  }

  void drain(size_t keep) {
    while (in_flight_.size() > keep && !dead_) {
      InFlight f = std::move(in_flight_.front());
      in_flight_.pop_front();
      bool timed_out = false;
      double waited = 0.0;
      const std::string err = wait(f.work, timed_out, waited);
      if (!err.empty()) {
        missing(f.ev, timed_out ? waited : 0.0, timed_out ? "" : err);
        gone_.push_back(std::move(f));
        return;
      }
      judge(f);
    }
  }

  void missing(const Event& ev, double waited, const std::string& error) {
    ReplicaReport r = report_of(ev, ReplicaReport::Moment::kMissing);
    for (const int64_t k : ranks_) {
      if (k != group_->getRank()) {
        r.missing.push_back(k);
        r.missing_detail.emplace_back();
      }
    }
    if (!error.empty() && !r.missing_detail.empty()) {
      r.missing_detail.front() = "the comparison failed: " + error.substr(0, 200);
    }
    r.waited_s = waited;
    emit(r);
    dead_ = true;  // later collectives would pair with the wrong ones
    for (InFlight& f : in_flight_) gone_.push_back(std::move(f));
    in_flight_.clear();
  }

  ReplicaReport report_of(const Event& ev, ReplicaReport::Moment m) const {
    ReplicaReport r;
    r.moment = m;
    r.step = ev.step;
    r.opt = ev.opt;
    r.group = setup_.name;
    r.ranks = ranks_;
    return r;
  }

  void emit(const ReplicaReport& r) {
    ctx_.events_seen.insert("rank_desync");
    ctx_.checks.replicas.on_report(r);
  }

  // Every rank's row, in group rank order; empty when the gather does not complete in time.
  std::vector<std::vector<int64_t>> gather(const std::vector<int64_t>& row) {
    std::vector<at::Tensor> in{to_tensor(row)};
    std::vector<std::vector<at::Tensor>> out(1);
    for (size_t k = 0; k < ranks_.size(); ++k) out[0].push_back(at::empty_like(in[0]));
    c10d::AllgatherOptions o;
    o.timeout = collective_timeout();
    auto work = group_->allgather(out, in, o);
    bool timed_out = false;
    double waited = 0.0;
    if (!wait(work, timed_out, waited).empty()) {
      gone_.push_back({work, in[0], {}, Event{}});
      dead_ = true;  // the sequences of collectives no longer pair up
      return {};
    }
    std::vector<std::vector<int64_t>> rows;
    for (const at::Tensor& t : out[0]) rows.push_back(to_vector(t));
    return rows;
  }

  void judge(const InFlight& f) {
    using O = ReplicaVerdict::Outcome;
    const std::vector<int64_t> both = to_vector(f.payload);
    const size_t n = both.size() / 2;
    std::vector<int64_t> hi(both.begin(), both.begin() + static_cast<std::ptrdiff_t>(n)), lo;
    for (size_t k = 0; k < n; ++k) lo.push_back(~both[n + k]);
    std::vector<std::pair<std::string, std::string>> known(known_.begin(), known_.end());
    const ReplicaVerdict v = judge_replica_payload(hi, lo, names_, buffer_names_, known);
    if (v.outcome == O::kAgree) return;
    if (v.outcome == O::kNotReplicas) {
      give_up(
          "the ranks hold different parameters (names, shapes or dtypes), so they are not "
          "replicas of one model; switch the check off (check.rank_desync=false) if intended");
      return;
    }
    const std::vector<std::vector<int64_t>> rows = gather(f.row);
    auto column = [&](int64_t field) {
      std::vector<int64_t> out;
      for (const auto& r : rows) out.push_back(r.at(static_cast<size_t>(field)));
      return out;
    };
    ReplicaReport r = report_of(f.ev, f.ev.first ? ReplicaReport::Moment::kBeforeFirstStep
                                                 : ReplicaReport::Moment::kAfterStep);
    if (!rows.empty() && v.forwards_differ) r.forwards = column(ReplicaRow::kForwards);
    if (v.outcome == O::kOutOfStep) {
      if (!rows.empty()) r.steps_at = column(ReplicaRow::kStep);
      dead_ = true;  // the sequences no longer pair up
    } else if (v.outcome == O::kSkipsDiffer) {
      if (!rows.empty()) {
        for (const int64_t s : column(ReplicaRow::kSkipped)) r.skipped.push_back(s != 0);
      }
      dead_ = true;  // every comparison after this one differs: said once
    } else {
      for (const ReplicaVerdict::Differ& d : v.differ) {
        known_.insert({d.what, d.tensor});
        ReplicaMismatch m{d.tensor, d.what, {}};
        if (d.shown && !rows.empty()) m.labels = replica_labels(column(d.field));
        r.mismatches.push_back(std::move(m));
      }
      r.grads_agree = v.grads_compared && !v.grads_differ;
      if (v.forwards_differ) dead_ = true;  // out of step
    }
    emit(r);
  }

  ReplicaFeed& feed_;
  FeedContext& ctx_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  ReplicaSetup setup_;
  std::vector<int64_t> ranks_;
  std::vector<int64_t> members_;
  std::vector<std::string> names_;
  std::vector<std::string> buffer_names_;
  std::vector<at::Tensor> buffers_;
  int64_t digest_ = 0;
  std::chrono::duration<double> timeout_{600.0};
  std::map<int64_t, int64_t> events_;  // optimizer -> step events so far (steps and skips)
  std::map<int64_t, int64_t> steps_;   // optimizer -> steps so far
  std::deque<Event> fifo_;
  std::deque<InFlight> in_flight_;
  std::vector<InFlight> gone_;  // collectives given up on: kept alive while they may run
  std::set<std::pair<std::string, std::string>> known_;  // (what, tensor) already reported
  bool dead_ = false;
};

}  // namespace
}  // namespace host

void compare_replicas(Sanitizer& san, c10::intrusive_ptr<c10d::ProcessGroup> group,
                      ReplicaSetup setup) {
  TORCH_CHECK_VALUE(group, "trainsan::compare_replicas: the process group is null");
  TORCH_CHECK_VALUE(group->getSize() > 1, "trainsan::compare_replicas: the process group has ",
                    group->getSize(),
                    " rank; replicas need a group of at least 2 ranks (a single process has "
                    "nothing to compare: do not call compare_replicas there)");
  host::ReplicaFeed& feed = host::replica_feed(host::ReplicaAccess::impl(san));
  TORCH_CHECK_VALUE(!feed.context().closed, "trainsan::compare_replicas: the sanitizer is closed");
  TORCH_CHECK_VALUE(!feed.driver,
                    "trainsan::compare_replicas: this sanitizer already compares replicas");
  TORCH_CHECK_VALUE(feed.context().opt_steps.empty(),
                    "trainsan::compare_replicas: call it before the first step (the replicas' "
                    "starting weights are compared at this call, and every rank must count the "
                    "same steps from it)");
  san.compare_replicas();
  if (!feed.enabled) return;  // rank_desync disabled
  auto driver = std::make_unique<host::PgReplicaDriver>(feed, std::move(group), std::move(setup));
  host::PgReplicaDriver& d = *driver;
  feed.driver = std::move(driver);
  d.first();
  host::ReplicaAccess::report(san);
}

}  // namespace trainsan
