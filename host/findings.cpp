// The FindingStore (findings.h).
#include "findings.h"

#include "messages.h"

namespace trainsan::host {

namespace {
// A finding's identity in the store: its kind's name and its subject.
std::string key_of(const std::string& kind, const std::string& tensor) {
  return kind + '\x1f' + tensor;
}
}  // namespace

const Finding* FindingStore::add(Kind kind, const std::string& tensor, const std::string& message,
                                 std::optional<double> value, int64_t step,
                                 std::optional<Severity> severity) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (enabled_.empty()) {
    for (const KindInfo& k : kinds()) enabled_.push_back(opts_.enabled(k.name));
  }
  if (!enabled_[static_cast<size_t>(kind)]) return nullptr;
  const KindInfo& k = info(kind);
  const std::string key = key_of(k.name, tensor);
  auto it = index_.find(key);
  if (it != index_.end()) {
    Finding& f = findings_[it->second];
    f.count += 1;
    f.last_step = step;
    return nullptr;
  }
  Finding f;
  f.kind = k.name;
  f.step = step;
  f.last_step = step;
  f.severity = severity_name(severity.value_or(k.severity));
  f.tensor = tensor;
  f.message = f.kind + " at step " + std::to_string(step) + ": " + message;
  f.value = value;
  index_[key] = findings_.size();
  findings_.push_back(f);
  trace_.finding(f);
  fresh_.push_back(f);
  return &findings_.back();
}

std::vector<Finding> FindingStore::all() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return findings_;
}

void FindingStore::said(Kind kind, const std::string& tensor) {
  const std::lock_guard<std::mutex> lock(mu_);
  said_.insert(key_of(info(kind).name, tensor));
}

void FindingStore::say_fresh(const std::string& policy) {
  const std::lock_guard<std::mutex> lock(mu_);
  for (const Finding& f : fresh_) {
    const std::string key = key_of(f.kind, f.tensor);
    if (policy_action(policy, f) == Action::kNone || said_.count(key) != 0) continue;
    print_finding(f);
    said_.insert(key);
  }
}

bool FindingStore::was_said(const Finding& f) const {
  const std::lock_guard<std::mutex> lock(mu_);
  return said_.count(key_of(f.kind, f.tensor)) > 0;
}

Finding FindingStore::attribute(const Finding& fallback, std::optional<bool> reproduces,
                                const std::string& text) {
  const std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(key_of(fallback.kind, fallback.tensor));
  Finding* f = nullptr;
  Finding copy = fallback;
  if (it != index_.end()) {
    f = &findings_[it->second];
  } else {
    f = &copy;
  }
  f->reproduces = reproduces;
  f->message += text;
  for (Finding& g : fresh_) {  // still to be reported (a LibTorch loop's event)
    if (g.kind == f->kind && g.tensor == f->tensor) g = *f;
  }
  return *f;
}

std::vector<Finding> FindingStore::take_fresh() {
  const std::lock_guard<std::mutex> lock(mu_);
  std::vector<Finding> out;
  out.swap(fresh_);
  return out;
}

}  // namespace trainsan::host
