#include <gtest/gtest.h>

#include "braid/core/tensor.h"
#include "test_devices.h"

namespace braid {
namespace {

TEST(Shape, NumelAndStr) {
  Shape s{2, 3, 4};
  EXPECT_EQ(s.dim(), 3);
  EXPECT_EQ(s.numel(), 24);
  EXPECT_EQ(s[-1], 4);
  EXPECT_EQ(s.str(), "[2, 3, 4]");
  EXPECT_EQ(Shape{}.numel(), 1);
  EXPECT_THROW((Shape{1, 2, 3, 4, 5, 6}), Error);
  EXPECT_THROW(s[3], Error);
}

TEST(Tensor, ViewsShareStorage) {
  Tensor flat = Tensor::zeros({12}, DType::f32);
  Tensor a = flat.slice(0, {2, 3});
  Tensor b = flat.slice(6, {6});
  a.data_ptr<float>()[4] = 5.0f;
  b.data_ptr<float>()[1] = 7.0f;
  EXPECT_EQ(flat.item(4), 5.0);
  EXPECT_EQ(flat.item(7), 7.0);
  EXPECT_EQ(flat.view({3, -1}).shape(), (Shape{3, 4}));
  Tensor rows = flat.view({4, 3}).narrow(1, 2);
  EXPECT_EQ(rows.shape(), (Shape{2, 3}));
  EXPECT_EQ(rows.item(1), 5.0);
  EXPECT_EQ(rows.item(4), 7.0);
  EXPECT_THROW(flat.slice(10, {3}), Error);
  EXPECT_THROW(flat.view({5, -1}), Error);
  EXPECT_THROW(flat.narrow(0, 13), Error);
}

TEST(Tensor, DTypeChecked) {
  Tensor t = Tensor::empty({3}, DType::bf16);
  EXPECT_THROW(t.data_ptr<float>(), Error);
  EXPECT_NO_THROW(t.data_ptr<uint16_t>());
  EXPECT_EQ(t.nbytes(), 6u);
  EXPECT_EQ(t.reinterpret(DType::f16).dtype(), DType::f16);
  EXPECT_THROW(t.reinterpret(DType::f32), Error);
}

TEST(Tensor, FromBlobRunsRelease) {
  static float data[4] = {1, 2, 3, 4};
  bool released = false;
  {
    Tensor t = Tensor::from_blob(data, {4}, DType::f32, Device::cpu(), [&] { released = true; });
    Tensor view = t.slice(2, {2});
    t = Tensor();
    EXPECT_FALSE(released);
    EXPECT_EQ(view.item(0), 3.0);
  }
  EXPECT_TRUE(released);
}

TEST(Allocator, ReportsCurrentAndPeak) {
  Device cpu = Device::cpu();
  reset_peak_memory(cpu);
  int64_t before = memory_stats(cpu).current_bytes;
  {
    Tensor a = Tensor::empty({1024}, DType::f32);
    EXPECT_EQ(memory_stats(cpu).current_bytes, before + 4096);
    Tensor b = Tensor::empty({256}, DType::f32);
  }
  EXPECT_EQ(memory_stats(cpu).current_bytes, before);
  EXPECT_EQ(memory_stats(cpu).peak_bytes, before + 4096 + 1024);
  reset_peak_memory(cpu);
  EXPECT_EQ(memory_stats(cpu).peak_bytes, before);
}

TEST(Allocator, ReusesLargeHostBlocks) {
  Device cpu = Device::cpu();
  int64_t before = memory_stats(cpu).current_bytes;
  void* first;
  {
    Tensor big = Tensor::empty({1 << 20}, DType::f32);  // 4 MiB
    first = big.data();
  }
  EXPECT_EQ(memory_stats(cpu).current_bytes, before);
  EXPECT_GE(memory_stats(cpu).reserved_bytes, before + (4 << 20));  // kept for reuse
  Tensor again = Tensor::empty({(1 << 20) - 5}, DType::f32);        // same size class
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(memory_stats(cpu).current_bytes, before + int64_t(again.nbytes()));
}

class TensorOnDevice : public ::testing::TestWithParam<Device> {};

TEST_P(TensorOnDevice, CopyRoundTrip) {
  Tensor host = testing::random_tensor({3, 5}, 1);
  Tensor dev = host.to(GetParam());
  EXPECT_EQ(dev.device(), GetParam());
  Tensor back = dev.to(Device::cpu());
  for (int64_t i = 0; i < host.numel(); ++i) EXPECT_EQ(back.item(i), host.item(i));
  Tensor z = Tensor::zeros({7}, DType::i32, GetParam());
  EXPECT_EQ(z.item(6), 0.0);
}

TEST_P(TensorOnDevice, CopyRejectsMismatch) {
  Tensor a = Tensor::empty({4}, DType::f32, GetParam());
  EXPECT_THROW(a.copy_from(Tensor::empty({5}, DType::f32)), Error);
  EXPECT_THROW(a.copy_from(Tensor::empty({4}, DType::i32)), Error);
}

INSTANTIATE_TEST_SUITE_P(Devices, TensorOnDevice, ::testing::ValuesIn(testing::test_devices()),
                         testing::device_test_name);

TEST(Device, Names) {
  EXPECT_EQ(device_from_name("cpu"), Device::cpu());
  EXPECT_EQ(device_from_name("cuda:1"), Device::cuda(1));
  EXPECT_EQ(Device::cuda(2).str(), "cuda:2");
  EXPECT_THROW(device_from_name("tpu"), ConfigError);
  EXPECT_THROW(device_from_name("cuda:x"), ConfigError);
}

}  // namespace
}  // namespace braid

namespace braid {
TEST(Tensor, SetItemRoundsAsACastAndItemReadsBack) {
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    Tensor t = Tensor::empty({3}, dtype);
    t.set_item(0, 3.0);
    t.set_item(2, 100.0);
    EXPECT_EQ(t.item(0), 3.0) << dtype_name(dtype);
    EXPECT_EQ(t.item(2), 100.0) << dtype_name(dtype);
    EXPECT_THROW(t.set_item(3, 1.0), Error);
  }
  Tensor bf = Tensor::empty({1}, DType::bf16);
  bf.set_item(0, 1.0 + 1.0 / 512);  // rounds to nearest even: 1.0
  EXPECT_EQ(bf.item(0), 1.0);
  Tensor big = Tensor::empty({1}, DType::i64);
  big.set_item(0, double(int64_t(1) << 40));
  EXPECT_EQ(big.data_ptr<int64_t>()[0], int64_t(1) << 40);
}
}  // namespace braid

#include "braid/core/json.h"

namespace braid {
TEST(Json, QuoteEscapesQuotesBackslashesAndControls) {
  EXPECT_EQ(json_quote("plain"), "\"plain\"");
  EXPECT_EQ(json_quote("a\"b\\c\nd\te"), "\"a\\\"b\\\\c\\nd\\te\"");
  EXPECT_EQ(json_quote(std::string("\x01", 1)), "\"\\u0001\"");
  EXPECT_EQ(json_quote("µs"), "\"µs\"");  // UTF-8 passes through
}
}  // namespace braid
