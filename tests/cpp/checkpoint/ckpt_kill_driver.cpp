// A small data-parallel training job (2 ranks, ZeRO), for kill_tests.py:
//   mpirun -np 2 ckpt_kill_driver --dir D --steps N [--save-interval K] [--async-save]
//       [--exit-interval I] [--exit-duration-in-mins M]
//     resumes from D's latest checkpoint (if any) and trains to N, saving every K steps
//     (default 1; 0: only when leaving early), and stops early - saving, exit 0 - on SIGTERM,
//     SIGUSR1, --exit-interval or --exit-duration-in-mins;
//   mpirun -np 2 ckpt_kill_driver --dir D --verify: loads the latest checkpoint.
// Prints "resumed I", "step I", "saving I" / "saved I" around each save, "exiting at I: why",
// "loaded I" with --verify; errors exit non-zero (comm::run_main).

#include <cstdio>
#include <cstring>
#include <string>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/engine/checkpoint.h"
#include "braid/engine/exit_conditions.h"
#include "tp/tp_test_util.h"

using namespace braid;

int main(int argc, char** argv) {
  return comm::run_main([&] {
    std::string dir;
    int steps = 0, save_interval = 1;
    bool verify = false, async_save = false;
    engine::ExitConfig exit;
    for (int i = 1; i < argc; ++i) {
      const bool value = i + 1 < argc;
      if (!std::strcmp(argv[i], "--dir") && value) dir = argv[++i];
      if (!std::strcmp(argv[i], "--steps") && value) steps = std::atoi(argv[++i]);
      if (!std::strcmp(argv[i], "--save-interval") && value) save_interval = std::atoi(argv[++i]);
      if (!std::strcmp(argv[i], "--exit-interval") && value)
        exit.exit_interval = std::atoi(argv[++i]);
      if (!std::strcmp(argv[i], "--exit-duration-in-mins") && value)
        exit.exit_duration_minutes = std::atof(argv[++i]);
      if (!std::strcmp(argv[i], "--async-save")) async_save = true;
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
    engine::ExitConditions exits(exit);
    engine::CheckpointSaver saver(dir, async_save);
    auto save = [&] {
      const long long it = trainer.iteration();
      if (root) std::printf("saving %lld\n", it);
      std::fflush(stdout);
      saver.save(trainer, {.consumed_samples = trainer.iteration() * 2});
      if (root) std::printf("saved %lld\n", it);
      std::fflush(stdout);
    };
    while (trainer.iteration() < steps) {
      const tp_testing::Batch b =
          tp_testing::batch(2, 16, config.vocab_size, uint64_t(trainer.iteration()));
      const int64_t first = state.dp_rank();
      trainer.train_step(b.ids.narrow(first, 1).clone(), b.targets.narrow(first, 1).clone(), 1);
      saver.poll(model);
      if (root) std::printf("step %lld\n", static_cast<long long>(trainer.iteration()));
      std::fflush(stdout);
      const std::string why = exits.check(model, trainer.iteration());
      if (!why.empty()) {
        save();
        saver.wait(model);
        if (root)
          std::printf("exiting at %lld: %s\n", static_cast<long long>(trainer.iteration()),
                      why.c_str());
        return 0;
      }
      if (save_interval > 0 && trainer.iteration() % save_interval == 0) save();
    }
    saver.wait(model);
    return 0;
  });
}
