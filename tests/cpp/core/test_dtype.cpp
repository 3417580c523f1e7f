#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "braid/core/dtype.h"
#include "braid/core/error.h"

namespace braid {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_from_name("bfloat16"), DType::bf16);
  EXPECT_EQ(dtype_from_name("f32"), DType::f32);
  EXPECT_THROW(dtype_from_name("f8"), ConfigError);
}

TEST(DType, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  // 1 + 2^-8 lies exactly between two bf16 values: ties go to the even mantissa (1.0).
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);
  // 1 + 3 * 2^-8 ties between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3f82);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity()))));
}

TEST(DType, Float16KnownValues) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.5f), 0xc100);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);       // largest finite
  EXPECT_EQ(float_to_f16(70000.0f), 0x7c00);       // overflows to inf
  EXPECT_EQ(float_to_f16(5.9604645e-8f), 0x0001);  // smallest subnormal
  EXPECT_EQ(f16_to_float(0x0001), 5.9604645e-8f);
  EXPECT_EQ(f16_to_float(0x3555), 0.333251953125f);
  EXPECT_EQ(float_to_f16(1.0f / 3.0f), 0x3555);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::nanf("")))));
  // Every finite f16 survives a round trip through f32.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    if ((bits & 0x7c00) == 0x7c00) continue;
    ASSERT_EQ(float_to_f16(f16_to_float(uint16_t(bits))), bits) << bits;
  }
}

}  // namespace
}  // namespace braid
