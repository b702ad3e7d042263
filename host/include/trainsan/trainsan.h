// TrainSan's public C++ API: the fused statistics pass, the training-loop sanitizer and its
// one-line front door (trainsan::attach).
#pragma once

#include "trainsan/attach.h"
#include "trainsan/finding.h"
#include "trainsan/kinds.h"
#include "trainsan/options.h"
#include "trainsan/sanitizer.h"
#include "trainsan/stats.h"
