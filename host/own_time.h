// TrainSan's own time (Note [Own time]): what overhead_seconds(), the trace's overhead_ms and the
// overhead budget read. One per sanitizer; the feeders add to it through FeedContext.
#pragma once

#include <chrono>

namespace trainsan::host {

// Note [Own time]
// ~~~~~~~~~~~~~~~~
// TrainSan's own time (overhead_seconds(), the trace's overhead_ms, the budget's measure of
// Note [Overhead budget]) is taken whole at the per-step entries: an OwnClock on the stack of
// forward, watch_loss, loss_reaches, step_begin, step_end, gradients_cleared and end_step
// counts all of the call (checks, readback, report) once, and the timed sections inside it
// (add_overhead) then add nothing. Elsewhere those sections count as before. Time spent outside
// any entry is added as measured by whoever spent it (add_outside: the op audit's dispatcher
// hooks, the Python side's own time, which the bindings pass in). The budget and the step
// record read the clock up to now (flush_clock) so that the running entry's time counts for
// its own step. Before this only sections were timed, and the Python side timed the forward's
// C++ call besides: what ran outside the sections (the checks' reports, report() and its
// callback) was missed and the forward's sections counted twice.
struct OwnTime {
  void add_overhead(double s) {
    if (clock_depth == 0) add_outside(s);
  }
  void add_outside(double s) {
    overhead_s += s;
    step_overhead_s += s;
  }
  void flush_clock() {
    if (clock_depth == 0) return;
    const auto now = std::chrono::steady_clock::now();
    add_outside(std::chrono::duration<double>(now - clock_mark).count());
    clock_mark = now;
  }
  int clock_depth = 0;  // OwnClocks on the stack
  std::chrono::steady_clock::time_point clock_mark{};
  double overhead_s = 0.0;       // total measured
  double step_overhead_s = 0.0;  // since the last step record
};

// Note [Own time]: times a per-step entry whole (nested entries count once).
class OwnClock {
 public:
  explicit OwnClock(OwnTime& t) : t_(t) {
    if (t_.clock_depth++ == 0) t_.clock_mark = std::chrono::steady_clock::now();
  }
  ~OwnClock() {
    t_.flush_clock();
    --t_.clock_depth;
  }
  OwnClock(const OwnClock&) = delete;
  OwnClock& operator=(const OwnClock&) = delete;

 private:
  OwnTime& t_;
};

}  // namespace trainsan::host
