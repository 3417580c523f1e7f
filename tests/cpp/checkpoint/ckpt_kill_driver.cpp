// A small data-parallel training job that saves after every step, for kill_tests.py:
//   mpirun -np 2 ckpt_kill_driver --dir D --steps N   resume from D's latest checkpoint (if
//                                                      any), train to N, saving each step
//   mpirun -np 2 ckpt_kill_driver --dir D --verify    load the latest checkpoint, print it
// Prints "resumed <iteration>", "saving <iteration>" before and "saved <iteration>" after
// each save, "loaded <iteration>" with --verify; errors exit non-zero (comm::run_main).

#include <cstdio>
#include <cstring>
#include <string>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/engine/checkpoint.h"
#include "tp/tp_test_util.h"

using namespace braid;

int main(int argc, char** argv) {
  return comm::run_main([&] {
    std::string dir;
    int steps = 0;
    bool verify = false;
    for (int i = 1; i < argc; ++i) {
      if (!std::strcmp(argv[i], "--dir") && i + 1 < argc) dir = argv[++i];
      if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::atoi(argv[++i]);
      if (!std::strcmp(argv[i], "--verify")) verify = true;
    }
    BRAID_CONFIG_CHECK(!dir.empty(), "usage: ckpt_kill_driver --dir D (--steps N | --verify)");
    auto world = comm::init_distributed(comm::timeout_from_minutes(1.0)).world;
    comm::ParallelState state(world, {.dp = world->size()});
    // ~6M parameters: a save (params + moments, 72 MB) takes much longer than a step.
    model::TransformerConfig config = model::TransformerConfig::preset("gpt2-tiny");
    config.num_layers = 2;
    config.hidden_size = 384;
    config.num_attention_heads = 4;
    config.num_query_groups = 4;
    config.ffn_hidden_size = 1536;
    config.vocab_size = 4096;
    config.max_position_embeddings = 16;
    engine::ParallelConfig parallel;
    parallel.ddp.use_distributed_optimizer = true;
    engine::ParallelModel model(config, Device::cpu(), 3, state, parallel);
    engine::TrainerConfig tc;
    tc.schedule.style = engine::LRDecayStyle::constant;
    engine::Trainer trainer(model, tc);
    const bool root = world->rank() == 0;
    if (engine::latest_iteration(dir) >= 0) {
      engine::load_checkpoint(dir, trainer);
      if (root)
        std::printf("%s %lld\n", verify ? "loaded" : "resumed",
                    static_cast<long long>(trainer.iteration()));
    }
    if (verify) return 0;
    while (trainer.iteration() < steps) {
      const tp_testing::Batch b =
          tp_testing::batch(2, 16, config.vocab_size, uint64_t(trainer.iteration()));
      const int64_t first = state.dp_rank();
      trainer.train_step(b.ids.narrow(first, 1).clone(), b.targets.narrow(first, 1).clone(), 1);
      if (root) std::printf("saving %lld\n", static_cast<long long>(trainer.iteration()));
      std::fflush(stdout);
      engine::save_checkpoint(dir, trainer, {.consumed_samples = trainer.iteration() * 2});
      if (root) std::printf("saved %lld\n", static_cast<long long>(trainer.iteration()));
      std::fflush(stdout);
    }
    return 0;
  });
}
