// TrainSan's public C++ API: the fused statistics pass and the training-loop sanitizer.
#pragma once

#include "trainsan/sanitizer.h"
#include "trainsan/stats.h"
