// AtomicDirectory, replace_file_atomically and the stale-temporary helpers, including a
// writer killed with SIGKILL mid-save (a forked child).

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "braid/ckpt/atomic_dir.h"
#include "braid/ckpt/safetensors.h"
#include "braid/core/error.h"

namespace braid::ckpt {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class AtomicDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("braid_atomic_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(AtomicDirTest, CommitRenamesACompleteDirectory) {
  const fs::path final_path = dir_ / "iter_0000010";
  AtomicDirectory d(final_path);
  EXPECT_NE(d.path().filename().string().find(".tmp-"), std::string::npos);
  EXPECT_EQ(d.path().parent_path(), dir_);
  fs::create_directories(d.path() / "sub");
  write_file(d.path() / "a.txt", "hello");
  write_file(d.path() / "sub" / "b.txt", "world");
  EXPECT_FALSE(fs::exists(final_path));
  d.commit();
  EXPECT_TRUE(d.committed());
  EXPECT_EQ(read_text(final_path / "a.txt"), "hello");
  EXPECT_EQ(read_text(final_path / "sub" / "b.txt"), "world");
  EXPECT_FALSE(fs::exists(d.path()));
  EXPECT_TRUE(stale_temporaries(dir_).empty());
}

TEST_F(AtomicDirTest, AbandonedDirectoryIsRemoved) {
  const fs::path final_path = dir_ / "iter_1";
  fs::path tmp;
  try {
    AtomicDirectory d(final_path);
    tmp = d.path();
    write_file(d.path() / "a.txt", "x");
    throw std::runtime_error("save failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_FALSE(fs::exists(final_path));
}

TEST_F(AtomicDirTest, ExistingFinalIsRefusedByDefault) {
  const fs::path final_path = dir_ / "iter_2";
  fs::create_directories(final_path);
  write_file(final_path / "old.txt", "old");
  EXPECT_THROW(AtomicDirectory{final_path}, ConfigError);
  // Appearing between construction and commit: still refused, nothing clobbered.
  const fs::path other = dir_ / "iter_3";
  AtomicDirectory d(other);
  write_file(d.path() / "new.txt", "new");
  fs::create_directories(other);
  write_file(other / "old.txt", "old");
  try {
    d.commit();
    ADD_FAILURE() << "commit over an existing directory succeeded";
  } catch (const ConfigError& e) {
    EXPECT_NE(e.message().find("already exists"), std::string::npos) << e.message();
  }
  EXPECT_EQ(read_text(other / "old.txt"), "old");
}

TEST_F(AtomicDirTest, ReplaceSwapsInOneStep) {
  const fs::path final_path = dir_ / "iter_4";
  fs::create_directories(final_path);
  write_file(final_path / "old.txt", "old");
  AtomicDirectory d(final_path, AtomicDirectory::Existing::replace);
  write_file(d.path() / "new.txt", "new");
  d.commit();
  EXPECT_EQ(read_text(final_path / "new.txt"), "new");
  EXPECT_FALSE(fs::exists(final_path / "old.txt"));
  EXPECT_TRUE(stale_temporaries(dir_).empty());
}

TEST_F(AtomicDirTest, ReplaceFileAtomically) {
  const fs::path latest = dir_ / "latest";
  replace_file_atomically(latest, "iter_0000010\n");
  EXPECT_EQ(read_text(latest), "iter_0000010\n");
  replace_file_atomically(latest, "iter_0000020\n");
  EXPECT_EQ(read_text(latest), "iter_0000020\n");
  EXPECT_TRUE(stale_temporaries(dir_).empty());
}

// A child writes a checkpoint forever (tensor files one after another) and is killed with
// SIGKILL: the final directory never appears, the previous checkpoint and `latest` are intact,
// and the temporary is found and removed.
TEST_F(AtomicDirTest, KilledWriterLeavesNoFinalDirectory) {
  const fs::path previous = dir_ / "iter_0000001";
  {
    AtomicDirectory d(previous);
    write_file(d.path() / "model.safetensors", "old");
    d.commit();
  }
  replace_file_atomically(dir_ / "latest", "iter_0000001");
  const fs::path final_path = dir_ / "iter_0000002";
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    AtomicDirectory d(final_path);
    Tensor t = Tensor::zeros({1 << 16}, DType::f32);
    for (int i = 0;; ++i) {
      SafetensorsWriter w;
      w.add("t", t);
      w.write((d.path() / ("part_" + std::to_string(i) + ".safetensors")).string());
      if (i == 2) {
        char c = 1;
        (void)!::write(ready[1], &c, 1);
      }
    }
  }
  ::close(ready[1]);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);  // the child is mid-save
  ::close(ready[0]);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

  EXPECT_FALSE(fs::exists(final_path));
  EXPECT_EQ(read_text(dir_ / "latest"), "iter_0000001");
  EXPECT_EQ(read_text(previous / "model.safetensors"), "old");
  auto stale = stale_temporaries(dir_);
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(stale[0].filename().string().rfind("iter_0000002.tmp-", 0), 0u) << stale[0];
  EXPECT_TRUE(fs::exists(stale[0] / "part_0.safetensors"));
  EXPECT_EQ(remove_stale_temporaries(dir_), stale);
  EXPECT_TRUE(stale_temporaries(dir_).empty());
  EXPECT_TRUE(fs::exists(previous));
}

}  // namespace
}  // namespace braid::ckpt
