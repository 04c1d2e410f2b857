// Number formats decoded straight from their definitions (in double), for tests that check the
// library's own conversions against an independent reading of the format.
#pragma once

#include <cstdint>

namespace m3msa::testkit {

// The value of an fp8 e4m3 (FN) code: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111
// is NaN, there are no infinities.
double fp8_e4m3_definition(uint8_t code);

// The value of an e8m0 scale code (MXFP8 block scales): 2^(code - 127); 255 is NaN.
double e8m0_definition(uint8_t code);

}  // namespace m3msa::testkit
