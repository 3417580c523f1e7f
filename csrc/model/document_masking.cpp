// Document masking (Megatron's --reset-attention-mask, --reset-position-ids): the tables of
// Tokens::key_start and Tokens::positions, from the whole sequences' ids.
#include "braid/core/error.h"
#include "braid/model/context_parallel.h"
#include "model/gpt_model_internal.h"

namespace braid::model {

void GPTModel::set_document_masking(int32_t eod, bool reset_attention_mask,
                                    bool reset_position_ids) {
  BRAID_CONFIG_CHECK(
      !(reset_attention_mask || reset_position_ids) || (eod >= 0 && eod < config_.vocab_size),
      "document masking (--reset-attention-mask, --reset-position-ids): the "
      "end-of-document token ",
      eod, " is not in the vocabulary [0, ", config_.vocab_size, ")");
  eod_ = eod;
  reset_attention_mask_ = reset_attention_mask;
  reset_position_ids_ = reset_position_ids;
}

void GPTModel::prepare_documents(Microbatch& mb, const int32_t* id, int64_t b, int64_t s) const {
  if (!reset_attention_mask_ && !reset_position_ids_) return;
  // Megatron's _get_ltor_masks_and_position_ids: the token after each eod starts a document.
  Tensor key_start = Tensor::empty({b, s}, DType::i32),
         positions = Tensor::empty({b, s}, DType::i32);
  int32_t* start_of = key_start.data_ptr<int32_t>();
  int32_t* position = positions.data_ptr<int32_t>();
  bool split = false;  // whether a document starts past position 0 anywhere
  for (int64_t r = 0; r < b; ++r) {
    int32_t start = 0;
    for (int64_t i = 0; i < s; ++i) {
      start_of[r * s + i] = start;
      position[r * s + i] = int32_t(i) - start;
      split = split || start > 0;
      if (id[r * s + i] == eod_) start = int32_t(i + 1);
    }
  }
  // Without a split the microbatch is the causal model's (and its attention stays on cuDNN's
  // kernels on a GPU): every rank decides alike from the same ids.
  if (split && reset_attention_mask_) mb.key_start = key_start.to(device_);
  if (split && reset_position_ids_) {
    mb.doc_positions_host = cp_.active() ? split_sequence(cp_, positions) : positions;
    mb.doc_positions = mb.doc_positions_host.to(device_);
  }
}

}  // namespace braid::model
