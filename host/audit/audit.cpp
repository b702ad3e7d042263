// OpAudit: one sanitizer's side of the op audits (Note [Op audit] in audit/observer.cpp).
#include "audit.h"

#include <utility>

#include "audit/core.h"
#include "finding_sink.h"
#include "readback.h"

namespace trainsan::host {

namespace audit {

void record(Core& c, Kind kind, const std::string& name, const std::string& message,
            std::optional<double> value, int64_t step, bool say_now) {
  const std::lock_guard<std::mutex> lock(c.mu);
  if (c.sink == nullptr) return;
  const Finding* f = c.sink->add(kind, name, message, value, step);
  // The op usually fails right after (IndexError, device-side assert), before the next event
  // could report the finding: say it now.
  if (f != nullptr && say_now && c.cfg.print_failing) {
    print_finding(*f);
    c.sink->said(kind, name);  // close() does not report it again
  }
}

}  // namespace audit

OpAudit::OpAudit(FindingSink& sink, ReadbackQueue& readback, AuditConfig cfg)
    : core_(std::make_shared<audit::Core>(std::move(cfg))) {
  core_->sink = &sink;
  core_->readback = &readback;
  audit::claim();
}

OpAudit::~OpAudit() {
  stop();
  bool was_open = false;
  {
    const std::lock_guard<std::mutex> lock(core_->mu);
    core_->sink = nullptr;
    core_->readback = nullptr;
    was_open = core_->open;
    core_->open = false;
  }
  if (was_open) audit::release();
}

void OpAudit::begin_forward(int64_t step) {
  audit::Core& c = *core_;
  if (!c.cfg.any()) return;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    if (!c.open || c.sink == nullptr) return;
  }
  c.step = step;
  if (step >= c.cfg.first_steps && (c.cfg.every <= 0 || step % c.cfg.every != 0)) return;
  audit::flush_deferred(c);
  c.last_target = audit::LastTarget();
  c.embedded.clear();
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    c.audited_forwards += 1;
  }
  c.active.store(true);
  audit::activate(core_);
}

void OpAudit::set_batch(std::vector<at::Tensor> batch) {
  if (!core_->cfg.on(Kind::label_dtype)) return;
  std::vector<at::Tensor> small;
  for (at::Tensor& t : batch) {
    if (t.defined() && t.layout() == at::kStrided && t.numel() > 0 &&
        (t.scalar_type() == at::kByte || t.scalar_type() == at::kChar ||
         t.scalar_type() == at::kShort)) {
      small.push_back(std::move(t));
    }
  }
  core_->batch = std::move(small);
}

void OpAudit::set_inputs(std::vector<at::Tensor> inputs) {
  if (!core_->cfg.on(Kind::target_leak)) return;
  std::vector<at::Tensor> tables;  // target_leak's feature tables (Note [Target leak])
  for (at::Tensor& t : inputs) {
    if (t.defined() && t.layout() == at::kStrided && t.dim() == 2 && t.size(1) >= 2 &&
        at::isFloatingType(t.scalar_type())) {
      tables.push_back(std::move(t));
    }
  }
  core_->inputs = std::move(tables);
}

void OpAudit::pause_this_thread(bool paused) { audit::pause_this_thread(paused); }

void OpAudit::stop() {
  if (!core_->active.load(std::memory_order_relaxed)) return;
  if (core_->active.exchange(false)) audit::deactivate(core_);
}

bool OpAudit::auditing() const { return core_->active.load(); }

void OpAudit::flush() { audit::flush_deferred(*core_); }

std::pair<int64_t, int64_t> OpAudit::coverage() const {
  const std::lock_guard<std::mutex> lock(core_->mu);
  return {core_->audited_forwards, core_->ops_audited};
}

double OpAudit::take_overhead() {
  const std::lock_guard<std::mutex> lock(core_->mu);
  return std::exchange(core_->overhead_s, 0.0);
}

void OpAudit::step_end() {
  stop();
  audit::flush_deferred(*core_);
  core_->last_target = audit::LastTarget();
  audit::end_leak_checks(*core_);
  audit::ship_device_checks(core_);
}

void OpAudit::close() {
  audit::Core& c = *core_;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    if (!c.open) return;
  }
  step_end();
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    c.open = false;
  }
  audit::release();
}

void OpAudit::check_target(const std::string& op, const at::Tensor& input, const at::Tensor& target,
                           std::optional<int64_t> ignore_index, int64_t num_classes, int64_t step) {
  audit::Core& c = *core_;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    if (!c.open) return;
  }
  const audit::OwnOps own;
  audit::check_class_target(c, op, input, target, ignore_index, num_classes, step, /*now=*/true,
                            /*from_op=*/false);
}

ClassTargetFacts OpAudit::class_targets(int64_t step) const {
  const std::lock_guard<std::mutex> lock(core_->mu);
  const auto it = core_->target_facts.find(step);
  return it == core_->target_facts.end() ? ClassTargetFacts() : it->second;
}

}  // namespace trainsan::host
