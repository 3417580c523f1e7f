#include "braid/data/batch_layout.h"

#include "braid/core/error.h"

namespace braid::data {

void BatchLayout::validate() const {
  BRAID_CONFIG_CHECK(micro_batch_size > 0, "micro_batch_size must be positive, got ",
                     micro_batch_size);
  BRAID_CONFIG_CHECK(dp_size > 0, "dp_size must be positive, got ", dp_size);
  BRAID_CONFIG_CHECK(0 <= dp_rank && dp_rank < dp_size, "dp_rank ", dp_rank,
                     " out of range for dp_size ", dp_size);
  BRAID_CONFIG_CHECK(global_batch_size > 0 && global_batch_size % (micro_batch_size * dp_size) == 0,
                     "global_batch_size (", global_batch_size,
                     ") must be a positive multiple of micro_batch_size x dp_size (",
                     micro_batch_size, " x ", dp_size, ")");
}

}  // namespace braid::data
