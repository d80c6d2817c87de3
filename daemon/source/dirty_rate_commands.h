// calc-dirty-rate and query-dirty-rate (QMP; HMP's calc_dirty_rate and
// info dirty_rate run them), as QEMU 10 answers them.
#pragma once

#include <memory>
#include <vector>

#include "daemon/source/dirty_rate.h"
#include "monitor/qmp_server.h"

namespace qmigd {

// Registers both commands over a source's `blocks`; the measurement they
// drive is returned for the daemon to keep (and end before the blocks).
std::unique_ptr<DirtyRateMeasure> register_dirty_rate_commands(QmpServer &server,
                                                               const std::vector<RAMBlock> &blocks);

} // namespace qmigd
