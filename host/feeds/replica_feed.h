// rank_desync's feeder (Sanitizer::compare_replicas, when enabled): the fingerprints of the passes
// checked since they were last taken, and the comparison itself where this library runs it
// (trainsan::compare_replicas over a c10d process group, host/replicas_pg.cpp), told of every step
// event and finished at close.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "feeds/feed.h"

namespace trainsan::host {

struct SanitizerImpl;

class ReplicaFeed final : public Feed {
 public:
  // host/replicas_pg.cpp's PgReplicaDriver (a trainsan::ReplicaEngine's driver).
  struct Driver {
    virtual ~Driver() = default;
    virtual void on_event(int64_t opt, bool skipped) = 0;  // after the event's pass
    virtual void finish() = 0;                             // close(): compare what is pending
  };

  using Feed::Feed;

  void after_step(int64_t opt, bool skipped) override {
    if (driver) driver->on_event(opt, skipped);
  }
  void close() override {
    if (driver) driver->finish();
  }
  FeedContext& context() { return ctx_; }

  bool enabled = false;                        // compare_replicas() with rank_desync enabled
  std::vector<StepFingerprints> fingerprints;  // of the passes checked since last taken
  std::unique_ptr<Driver> driver;
};

/// The replica feeder of a sanitizer (sanitizer.cpp): trainsan::compare_replicas's way in.
ReplicaFeed& replica_feed(SanitizerImpl& impl);

}  // namespace trainsan::host
