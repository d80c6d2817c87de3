// XBZRLE, QEMU's delta encoding of a page against the copy sent before
// (migration/xbzrle.c): the XOR of the two pages as alternating runs,
//
//   page  = zrun nzrun [page]     zrun  = length
//   nzrun = length byte...        length = ULEB128, at most 14 bits
//
// a zero run is bytes that did not change, a non-zero run the new bytes
// themselves. A trailing zero run is left out, so an unchanged page
// encodes to nothing. Pure functions on buffers: the page cache is the
// source's (ramstate/page_cache.h), the record framing savevm.h's.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qmigd {

// The XBZRLE record's encoding byte (ENCODING_FLAG_XBZRLE).
constexpr uint8_t XBZRLE_ENCODING_FLAG = 0x1;

// Encodes the change from old_page to new_page (len bytes each, len a
// multiple of 8 and below 2^14) into dst. Returns the encoded length, 0 if
// the pages are equal, -1 if it would not fit in dlen (send the page whole).
int xbzrle_encode(const uint8_t *old_page, const uint8_t *new_page, size_t len, uint8_t *dst,
                  size_t dlen);

// Applies an encoded change of slen bytes to page (dlen bytes), in place.
// Returns the bytes covered, or -1 on any malformed input: a length past
// 14 bits, a zero-length run where QEMU forbids one, a run past the page or
// past the input. Never reads or writes outside the two buffers.
int xbzrle_decode(const uint8_t *src, size_t slen, uint8_t *page, size_t dlen);

} // namespace qmigd
