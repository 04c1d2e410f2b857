// The CLI's correctness checks are the test kit's comparison module (m3msa/testing/checks.h),
// named here in the CLI's namespace.
#pragma once

#include "m3msa/testing/checks.h"

namespace m3msa::cli {

using testkit::check_selections_vs_scores;
using testkit::check_selections_wellformed;
using testkit::CheckResult;
using testkit::compare_exact;
using testkit::compare_values;
using testkit::coordinates;
using testkit::kCrossBackendUlps;
using testkit::kSameBackendUlps;
using testkit::kSelectionTieTolerance;
using testkit::kUlpFloor;

}  // namespace m3msa::cli
