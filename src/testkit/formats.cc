// Number formats from their definitions (formats.h).
#include "m3msa/testing/formats.h"

#include <cmath>

namespace m3msa::testkit {

double fp8_e4m3_definition(uint8_t code) {
  const int sign = code >> 7;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::nan("");
  const double magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0, -6)
                                         : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

double e8m0_definition(uint8_t code) {
  return code == 255 ? std::nan("") : std::ldexp(1.0, static_cast<int>(code) - 127);
}

}  // namespace m3msa::testkit
