#pragma once
// CRC-32C (Castagnoli, the iSCSI polynomial 0x1EDC6F41, reflected; RFC 3720 B.4): the checksum
// braid's checkpoints record for each tensor they save and check when they load it. On x86-64
// with SSE4.2 it runs on the CPU's crc32 instruction, elsewhere a byte-table loop; both give
// the same value.

#include <cstdint>
#include <span>

namespace braid::ckpt {

// The CRC-32C of `data` continuing from `crc` (0 to start): crc32c(b, crc32c(a)) ==
// crc32c(a followed by b).
uint32_t crc32c(std::span<const uint8_t> data, uint32_t crc = 0);

namespace detail {
uint32_t crc32c_table(std::span<const uint8_t> data, uint32_t crc);  // the portable loop
}  // namespace detail

}  // namespace braid::ckpt
