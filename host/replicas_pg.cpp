// rank_desync's schedule of collectives (trainsan::ReplicaEngine, trainsan/replica_engine.h) and
// the replica comparison of a LibTorch program over a c10d process group that drives it
// (trainsan::compare_replicas, trainsan/replicas.h).
//
// Note [Replica comparison over c10d]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One ReplicaEngine per replica set owns the schedule of its collectives, for both drivers: this
// file's PgReplicaDriver (a LibTorch program's compare_replicas) and the Python package
// (bindings/trainsan/replicas.py, Note [Replica comparison], through _trainsan_hot: Note [One
// orchestration] in bindings/csrc/hot.cpp, which takes the side group as a c10d::ProcessGroup by
// torch's pybind11 caster). Per step event the driver gives the engine what this rank knows
// (ReplicaRowFacts); the engine builds the row (trainsan::replica_row, Note [Replica payload]),
// all-reduces (MAX) [row, ~row] on the set's group and reads the result at the next event
// (drain(1); drain(0) at close), so the training does not wait for it; the verdict is
// trainsan::judge_replica_payload. A comparison that does not complete within desync_timeout
// seconds (polled: Work::isCompleted), or fails (a peer left), reports the missing ranks
// (ReplicaReport::kMissing) and the set is not compared any more; nor after the ranks were found
// out of step, skipping differently or at different training forwards (their sequences no longer
// pair up), nor when they are not replicas (a warning). The Work of a comparison given up on stays
// referenced until the engine goes. The schedule depends only on the sequence of events, never
// on timing, so every rank issues the same collectives in the same order.
//
// What differs between the drivers is injected (ReplicaSteps), with c10d defaults:
// * which members are missing: by default every other rank of the group; Python reads the
//   store's closed/late keys (a rank that closed its sanitizer after fewer comparisons is named,
//   and polled for while waiting, so the wait ends at once);
// * which rank holds which value, where something differs: by default an all-gather of the rows
//   on the group (a failure ends the comparison: later collectives would pair with the wrong
//   ones); Python asks the store, which pairs nothing by order;
// * the reports (the sanitizer's replica_report) and the warning when the comparison stops
//   (stderr here, warnings.warn in Python).
// What the drivers themselves still do differently: this one compares one set (every parameter
// of the sanitizer over the caller's group, whose ranks are 0..size-1; no DTensor placements, no
// optimizer state: a torch::optim::Optimizer's state is not readable generically) and compares
// the weights replicas start from when compare_replicas() is called (before the loop), Python at
// the first optimizer step. A failure of the comparison's own machinery stops it with a warning,
// never reaching the training.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "checks/replicas.h"
#include "feeds/replica_feed.h"
#include "trainsan/replica_engine.h"
#include "trainsan/replicas.h"

namespace trainsan {

namespace {

using Clock = std::chrono::steady_clock;

// An error's message for a finding: a c10::Error without its C++ backtrace.
std::string brief(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

at::Tensor to_tensor(const std::vector<int64_t>& v) {
  return at::tensor(c10::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong)).clone();
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  const int64_t* d = c.const_data_ptr<int64_t>();
  return {d, d + c.numel()};
}

}  // namespace

// -- ReplicaEngine ----------------------------------------------------------------------------

ReplicaEngine::ReplicaEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, ReplicaSetSpec spec,
                             ReplicaSteps steps)
    : group_(std::move(group)),
      spec_(std::move(spec)),
      steps_(std::move(steps)),
      timeout_(spec_.timeout_s) {
  TORCH_CHECK_VALUE(group_, "trainsan::ReplicaEngine: the process group is null");
  TORCH_CHECK_VALUE(steps_.report, "trainsan::ReplicaEngine: no report step");
  TORCH_CHECK_VALUE(static_cast<int64_t>(spec_.ranks.size()) == group_->getSize(),
                    "trainsan::ReplicaEngine: ", spec_.ranks.size(), " ranks named for a group of ",
                    group_->getSize());
  TORCH_CHECK_VALUE(spec_.members.size() == spec_.member_names.size(),
                    "trainsan::ReplicaEngine: members and member_names differ in length");
  TORCH_CHECK_VALUE(spec_.timeout_s > 0, "trainsan::ReplicaEngine: timeout_s must be positive");
}

ReplicaEngine::~ReplicaEngine() = default;

void ReplicaEngine::launch(ReplicaRowFacts facts, bool first) {
  if (dead_) return;
  facts.digest = spec_.digest;
  std::vector<int64_t> row = replica_row(facts, spec_.members, spec_.buffer_names.size());
  std::vector<int64_t> both = row;
  for (const int64_t x : row) both.push_back(~x);
  std::vector<at::Tensor> payload{to_tensor(both)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  if (spec_.collective_timeout) o.timeout = *spec_.collective_timeout;
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = group_->allreduce(payload, o);
  } catch (const std::exception& e) {  // the group is gone (torn down)
    give_up("its collective failed: " + brief(e));
    return;
  }
  in_flight_.push_back(
      {std::move(work), payload[0], std::move(row), launched_++, facts.step, facts.opt, first});
}

void ReplicaEngine::give_up(const std::string& why) {
  if (dead_) return;
  dead_ = true;
  if (steps_.warn) {
    steps_.warn(why);
  } else {
    std::cerr << "trainsan: rank_desync stops comparing " << spec_.context << ": " << why << "\n";
  }
}

// Waits for `work` up to timeout_s, asking gone() now and then whether a member will never come.
// "" when it completed; otherwise why not (`timed_out`: the time ran out).
std::string ReplicaEngine::wait(const c10::intrusive_ptr<c10d::Work>& work, int64_t seq,
                                bool& timed_out) {
  const auto t0 = Clock::now();
  auto next_look = t0 + std::chrono::milliseconds(50);
  timed_out = false;
  while (!work->isCompleted()) {
    const auto now = Clock::now();
    const auto spent = now - t0;
    if (spent >= timeout_) {
      timed_out = true;
      return "it did not complete";
    }
    if (steps_.gone && now >= next_look) {
      next_look = now + std::chrono::milliseconds(500);
      if (steps_.gone(seq)) return "a member closed before it";
    }
    std::this_thread::sleep_for(spent < std::chrono::milliseconds(10)
                                    ? std::chrono::microseconds(200)
                                    : std::chrono::microseconds(5000));
  }
  try {
    work->wait();
  } catch (const std::exception& e) {  // a peer left: connection closed
    return "the comparison failed: " + brief(e).substr(0, 200);
  }
  return "";
}

void ReplicaEngine::drain(size_t keep) {
  while (in_flight_.size() > keep && !dead_) {
    InFlight f = std::move(in_flight_.front());
    in_flight_.pop_front();
    bool timed_out = false;
    const std::string err = wait(f.work, f.seq, timed_out);
    if (!err.empty()) {
      gone_.push_back({f.work, {f.payload}});
      missing(f, timed_out, err.rfind("the comparison failed: ", 0) == 0 ? err : "");
      return;
    }
    judge(f);
  }
}

void ReplicaEngine::missing(const InFlight& f, bool timed_out, const std::string& error) {
  ReplicaMissing m;
  if (steps_.missing) {
    m = steps_.missing(f.seq, timed_out);
  } else {
    for (const int64_t r : spec_.ranks) {
      if (r != spec_.rank) {
        m.ranks.push_back(r);
        m.detail.emplace_back();
      }
    }
  }
  ReplicaReport r = report_of(f, ReplicaReport::Moment::kMissing);
  r.missing = std::move(m.ranks);
  r.missing_detail = std::move(m.detail);
  const bool said = std::any_of(r.missing_detail.begin(), r.missing_detail.end(),
                                [](const std::string& d) { return !d.empty(); });
  if (!error.empty() && !said) r.missing_detail.push_back(error);
  r.waited_s = timed_out ? spec_.timeout_s : 0.0;
  dead_ = true;  // later collectives would pair with the wrong ones
  for (InFlight& g : in_flight_) gone_.push_back({g.work, {g.payload}});
  in_flight_.clear();
  steps_.report(r);
}

ReplicaReport ReplicaEngine::report_of(const InFlight& f, ReplicaReport::Moment m) const {
  ReplicaReport r;
  r.moment = m;
  r.step = f.step;
  r.opt = f.opt;
  r.group = spec_.context;
  r.ranks = spec_.ranks;
  return r;
}

// The c10d rows step: every member's row by an all-gather on the group, `fields` of each.
std::optional<std::vector<std::vector<int64_t>>> ReplicaEngine::gather(
    int64_t seq, const std::vector<int64_t>& row, const std::vector<int64_t>& fields) {
  std::vector<at::Tensor> in{to_tensor(row)};
  std::vector<std::vector<at::Tensor>> out(1);
  for (size_t k = 0; k < spec_.ranks.size(); ++k) out[0].push_back(at::empty_like(in[0]));
  c10d::AllgatherOptions o;
  if (spec_.collective_timeout) o.timeout = *spec_.collective_timeout;
  auto work = group_->allgather(out, in, o);
  bool timed_out = false;
  if (!wait(work, seq, timed_out).empty()) {
    std::vector<at::Tensor> held = in;
    held.insert(held.end(), out[0].begin(), out[0].end());
    gone_.push_back({work, std::move(held)});
    dead_ = true;  // the sequences of collectives no longer pair up
    return std::nullopt;
  }
  std::vector<std::vector<int64_t>> rows;
  for (const at::Tensor& t : out[0]) {
    const std::vector<int64_t> all = to_vector(t);
    std::vector<int64_t> picked;
    for (const int64_t field : fields) picked.push_back(all.at(static_cast<size_t>(field)));
    rows.push_back(std::move(picked));
  }
  return rows;
}

void ReplicaEngine::judge(const InFlight& f) {
  using O = ReplicaVerdict::Outcome;
  using Moment = ReplicaReport::Moment;
  const std::vector<int64_t> both = to_vector(f.payload);
  const size_t n = both.size() / 2;
  std::vector<int64_t> hi(both.begin(), both.begin() + static_cast<std::ptrdiff_t>(n)), lo;
  for (size_t k = 0; k < n; ++k) lo.push_back(~both[n + k]);
  const std::vector<std::pair<std::string, std::string>> known(known_.begin(), known_.end());
  const ReplicaVerdict v =
      judge_replica_payload(hi, lo, spec_.member_names, spec_.buffer_names, known);
  if (v.outcome == O::kAgree) return;
  if (v.outcome == O::kNotReplicas) {
    give_up(
        "the ranks hold different parameters (names, shapes, dtypes or placements) in it, so "
        "they are not replicas of one model (pipeline stages?); switch the check off with " +
        spec_.switch_off + " if intended");
    return;
  }
  // Which member holds which value: the fields the verdict asks for, from every member.
  const std::optional<std::vector<std::vector<int64_t>>> rows =
      steps_.rows ? steps_.rows(f.seq, f.row, v.fetch) : gather(f.seq, f.row, v.fetch);
  auto column = [&](int64_t field) {
    std::vector<int64_t> out;
    const auto at = std::find(v.fetch.begin(), v.fetch.end(), field);
    if (!rows || at == v.fetch.end()) return out;
    const auto c = static_cast<size_t>(at - v.fetch.begin());
    for (const auto& r : *rows) out.push_back(r.at(c));
    return out;
  };
  ReplicaReport r = report_of(f, Moment::kAfterStep);
  if (v.forwards_differ) r.forwards = column(ReplicaRow::kForwards);
  if (v.outcome == O::kOutOfStep) {
    r.steps_at = column(ReplicaRow::kStep);
    dead_ = true;  // the sequences no longer pair up
  } else if (v.outcome == O::kSkipsDiffer) {
    for (const int64_t s : column(ReplicaRow::kSkipped)) r.skipped.push_back(s != 0);
    dead_ = true;  // every comparison after this one differs: said once
  } else {
    if (f.first) r.moment = Moment::kBeforeFirstStep;
    for (const ReplicaVerdict::Differ& d : v.differ) {
      known_.insert({d.what, d.tensor});
      ReplicaMismatch m{d.tensor, d.what, {}};
      if (d.shown && rows) m.labels = replica_labels(column(d.field));
      r.mismatches.push_back(std::move(m));
    }
    r.grads_agree = v.grads_compared && !v.grads_differ;
    if (v.forwards_differ) dead_ = true;  // out of step: later comparisons pair different steps
  }
  steps_.report(r);
}

// -- compare_replicas: one set over the caller's group ----------------------------------------

namespace host {

struct ReplicaAccess {
  static SanitizerImpl& impl(Sanitizer& san) { return *san.impl_; }
  static void report(Sanitizer& san) { san.report(); }  // the policy's answer to new findings
};

namespace {

uint64_t fold(uint64_t h, const std::string& s) {
  for (const unsigned char c : s) h = (h ^ c) * 0x100000001B3ULL;
  return (h ^ 0xFF) * 0x100000001B3ULL;  // a separator, so ("ab","c") != ("a","bc")
}

std::string layout_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << ' ' << t.scalar_type();
  return os.str();
}

// The engine's spec for the sanitizer's parameters (and buffers) over `group`.
ReplicaSetSpec spec_of(const FeedContext& ctx, const c10d::ProcessGroup& group, ReplicaSetup& setup,
                       std::vector<at::Tensor>& buffers) {
  ReplicaSetSpec spec;
  spec.context = setup.name.empty()
                     ? "the data-parallel group (the process group given to compare_replicas)"
                     : setup.name;
  for (int r = 0; r < group.getSize(); ++r) spec.ranks.push_back(r);
  spec.rank = group.getRank();
  uint64_t h = fold(0xCBF29CE484222325ULL, spec.context + "/" + std::to_string(spec.ranks.size()));
  for (size_t i = 0; i < ctx.params.size(); ++i) {
    spec.members.push_back(static_cast<int64_t>(i));
    spec.member_names.push_back(ctx.params[i].name);
    h = fold(fold(h, ctx.params[i].name), layout_of(ctx.params[i].data()));
  }
  if (ctx.opts.desync_buffers) {
    for (const auto& [name, t] : setup.buffers) {
      if (!t.defined()) continue;
      spec.buffer_names.push_back(name);
      buffers.push_back(t);
      h = fold(fold(h, "buffer " + name), layout_of(t));
    }
  }
  spec.digest = static_cast<int64_t>(h);
  spec.timeout_s = ctx.opts.desync_timeout;
  // Past desync_timeout (which the engine polls, so that a missing rank is reported as such),
  // and finite, so that a collective given up on ends by itself.
  spec.collective_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::duration<double>(2 * spec.timeout_s)) +
                            std::chrono::milliseconds(1000);
  return spec;
}

// The events of the sanitizer's optimizers, paired with their passes' fingerprints, for one
// engine.
class PgReplicaDriver final : public ReplicaFeed::Driver {
 public:
  PgReplicaDriver(ReplicaFeed& feed, c10::intrusive_ptr<c10d::ProcessGroup> group,
                  ReplicaSetup setup)
      : feed_(feed), ctx_(feed.context()), setup_(std::move(setup)) {
    ReplicaSteps steps;
    steps.report = [this](const ReplicaReport& r) {
      ctx_.events_seen.insert("rank_desync");
      ctx_.checks.replicas.on_report(r);
    };
    ReplicaSetSpec spec = spec_of(ctx_, *group, setup_, buffers_);
    engine_ = std::make_unique<ReplicaEngine>(std::move(group), std::move(spec), std::move(steps));
  }

  // The weights the replicas start from: one blocking comparison.
  void first() {
    guarded([&] {
      ReplicaRowFacts ev;
      ev.forwards = ctx_.coverage.training_forwards;
      std::vector<at::Tensor> ts;
      for (const TrackedParam& p : ctx_.params) ts.push_back(p.data().detach());
      const std::vector<TensorStats> stats = tensor_stats(ts);
      for (size_t i = 0; i < stats.size(); ++i) {
        ev.fingerprints.index.push_back(static_cast<int64_t>(i));
        ev.fingerprints.param.push_back(static_cast<int64_t>(stats[i].hash));
        ev.fingerprints.grad.push_back(0);
        ev.fingerprints.has_grad.push_back(false);
      }
      engine_->launch(std::move(ev), /*first=*/true);
      engine_->drain(0);
    });
  }

  void on_event(int64_t opt, bool skipped) override {
    if (engine_->stopped()) return;
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
      if (ev.waiting && sampled && setup_.grads) ev.grads = engine_->spec().members;
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
    if (!engine_->stopped()) guarded([&] { pump(true); });
  }

 private:
  struct Event : ReplicaRowFacts {
    bool waiting = true;  // its pass's fingerprints have not landed yet
  };

  template <typename F>
  void guarded(F&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      engine_->give_up(std::string("its comparison failed: ") + brief(e));
    }
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
    while (!fifo_.empty() && (!fifo_.front().waiting || final) && !engine_->stopped()) {
      engine_->launch(std::move(fifo_.front()));
      fifo_.pop_front();
    }
    engine_->drain(final ? 0 : 1);
  }

  ReplicaFeed& feed_;
  FeedContext& ctx_;
  ReplicaSetup setup_;
  std::vector<at::Tensor> buffers_;
  std::unique_ptr<ReplicaEngine> engine_;
  std::map<int64_t, int64_t> events_;  // optimizer -> step events so far (steps and skips)
  std::map<int64_t, int64_t> steps_;   // optimizer -> steps so far
  std::deque<Event> fifo_;
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
