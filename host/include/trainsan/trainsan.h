// TrainSan's public C++ API: the fused statistics pass and the training-loop sanitizer.
#pragma once

#include "trainsan/finding.h"
#include "trainsan/kinds.h"
#include "trainsan/options.h"
#include "trainsan/sanitizer.h"
#include "trainsan/stats.h"
