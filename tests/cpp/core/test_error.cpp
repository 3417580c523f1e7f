#include <gtest/gtest.h>

#include "braid/core/error.h"
#include "braid/core/log.h"

namespace braid {
namespace {

TEST(Error, MessageNamesLocationAndRank) {
  try {
    BRAID_CHECK(1 + 1 == 3, "arithmetic is broken: ", 2, " != ", 3);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "arithmetic is broken: 2 != 3");
    EXPECT_NE(std::string(e.what()).find("test_error.cpp:"), std::string::npos);
    EXPECT_EQ(e.rank(), -1);
  }
  set_error_rank(3);
  try {
    BRAID_CONFIG_CHECK(false, "bad field");
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.rank(), 3);
    EXPECT_NE(std::string(e.what()).find("rank 3"), std::string::npos);
  }
  set_error_rank(-1);
}

TEST(Log, Levels) {
  EXPECT_EQ(log::level_from_name("warn"), log::Level::warn);
  EXPECT_THROW(log::level_from_name("loud"), ConfigError);
  log::Level saved = log::level();
  log::set_level(log::Level::error);
  EXPECT_EQ(log::level(), log::Level::error);
  log::set_level(saved);
}

}  // namespace
}  // namespace braid
