#pragma once
// The one piece of JSON writing braid's tools share: a string as a quoted, escaped JSON value.

#include <string>
#include <string_view>

namespace braid {

// "s" with ", \ and control characters escaped (\n, \t, \u00XX); other bytes pass through.
std::string json_quote(std::string_view s);

}  // namespace braid
