#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <fcntl.h>
#include <thread>
#include <unistd.h>

#include "ramstate/dirty_bitmap.h"
#include "ramstate/guest_control.h"
#include "ramstate/ram_image.h"
#include "ramstate/zero_page.h"

using namespace qmigd;

namespace {

std::string shm_path(const char *tag)
{
    return "/dev/shm/qmigd-unit-" + std::string(tag) + "-" + std::to_string(getpid());
}

struct Unlink {
    std::string path;
    ~Unlink() { ::unlink(path.c_str()); }
};

} // namespace

TEST_CASE("zero-page detection sees a single non-zero byte anywhere", "[zero_page]")
{
    alignas(64) static uint8_t page[TARGET_PAGE_SIZE];
    std::memset(page, 0, sizeof(page));
    CHECK(buffer_is_zero_page(page));
    for (size_t i = 0; i < TARGET_PAGE_SIZE; i++) {
        page[i] = uint8_t(1 + i % 255);
        REQUIRE_FALSE(buffer_is_zero_page(page));
        page[i] = 0;
    }
    // Unaligned pages too.
    static uint8_t raw[TARGET_PAGE_SIZE + 1];
    CHECK(buffer_is_zero_page(raw + 1));
    raw[TARGET_PAGE_SIZE] = 1;
    CHECK_FALSE(buffer_is_zero_page(raw + 1));
}

TEST_CASE("RAM image: create, size checks, holes and zero pages", "[ram_image]")
{
    Unlink u{shm_path("img")};
    auto img = RamImage::open(u.path, 8 * TARGET_PAGE_SIZE);
    REQUIRE(img.ok());
    RamImage &r = **img;
    CHECK(r.pages() == 8);
    r.host(3 * TARGET_PAGE_SIZE)[5] = 9;
    r.scan_holes();
    CHECK(r.known_zero(0));
    CHECK_FALSE(r.known_zero(3));
    REQUIRE(r.zero_page(3 * TARGET_PAGE_SIZE).ok());
    CHECK(r.host(3 * TARGET_PAGE_SIZE)[5] == 0);
    // A page written after the scan stops being "known zero".
    std::vector<uint8_t> ones(2 * TARGET_PAGE_SIZE, 1);
    REQUIRE(r.write(0, ones.data(), ones.size()).ok());
    CHECK_FALSE(r.known_zero(0));
    CHECK_FALSE(r.known_zero(1));
    CHECK(r.known_zero(2));
    CHECK(r.host(TARGET_PAGE_SIZE + 4095)[0] == 1); // the mapping sees file writes
    REQUIRE(r.zero_page(0).ok());
    CHECK(r.host(0)[0] == 0);
    CHECK(r.host(TARGET_PAGE_SIZE)[0] == 1);
    std::vector<uint8_t> back(TARGET_PAGE_SIZE);
    REQUIRE(r.read(TARGET_PAGE_SIZE, back.data(), back.size()).ok());
    CHECK(back[4095] == 1);
    CHECK_FALSE(r.read(8 * TARGET_PAGE_SIZE, back.data(), 1).ok()); // past the end

    CHECK_FALSE(RamImage::open(u.path, 4 * TARGET_PAGE_SIZE).ok()); // file larger than size
    CHECK_FALSE(RamImage::open(u.path, 4097).ok());                 // not page aligned
    auto again = RamImage::open(u.path, 0);                          // size from the file
    REQUIRE(again.ok());
    CHECK((*again)->size() == 8 * TARGET_PAGE_SIZE);
    CHECK_FALSE(RamImage::open("/dev/shm/qmigd-unit-missing-dir/x", 0).ok());
}

TEST_CASE("dirty bitmap: get-and-clear collects each set bit once", "[dirty_bitmap]")
{
    Unlink u{shm_path("bm")};
    auto bm = DirtyBitmap::open(u.path, 130);
    REQUIRE(bm.ok());
    DirtyBitmap &b = **bm;
    CHECK(b.words() == 3);
    std::vector<uint64_t> dest(3, 0);
    b.set_dirty(0);
    b.set_dirty(64);
    b.set_dirty(129);
    CHECK(b.sync_and_clear(dest) == 3);
    CHECK(dest[0] == 1);
    CHECK(dest[1] == 1);
    CHECK(dest[2] == 2);
    CHECK(b.sync_and_clear(dest) == 0);
    b.set_dirty(0); // already pending in dest: not counted twice
    CHECK(b.sync_and_clear(dest) == 0);
    // Bits past page 129 (of 130) are ignored, never handed on.
    std::fill(dest.begin(), dest.end(), 0);
    b.set_dirty(130);
    b.set_dirty(191);
    CHECK(b.sync_and_clear(dest) == 0);
    CHECK(dest[2] == 0);
    // The file is the documented format: little-endian words.
    int fd = ::open(u.path.c_str(), O_RDONLY);
    off_t len = lseek(fd, 0, SEEK_END);
    ::close(fd);
    CHECK(len == 24);
}

TEST_CASE("dirty bitmap: no bit is lost while a writer races with syncs", "[dirty_bitmap]")
{
    Unlink u{shm_path("race")};
    constexpr uint64_t kPages = 4096;
    auto bm = DirtyBitmap::open(u.path, kPages);
    REQUIRE(bm.ok());
    DirtyBitmap &b = **bm;
    std::atomic<bool> done{false};
    std::thread writer([&] {
        for (uint64_t round = 0; round < 50; round++) {
            for (uint64_t p = 0; p < kPages; p++) {
                b.set_dirty(p);
            }
        }
        done = true;
    });
    // Each page is set 50 times; between syncs we clear dest, so every page
    // must show up at least once and the last round's bits must not be lost.
    std::vector<uint64_t> seen(kPages / 64, 0);
    while (!done) {
        std::vector<uint64_t> dest(kPages / 64, 0);
        b.sync_and_clear(dest);
        for (size_t i = 0; i < dest.size(); i++) {
            seen[i] |= dest[i];
        }
    }
    writer.join();
    std::vector<uint64_t> dest(kPages / 64, 0);
    b.sync_and_clear(dest);
    for (size_t i = 0; i < dest.size(); i++) {
        seen[i] |= dest[i];
    }
    for (auto w : seen) {
        REQUIRE(w == ~uint64_t(0));
    }
}

TEST_CASE("guest control: pause is a handshake; no guest means no wait", "[guest_control]")
{
    Unlink u{shm_path("ctl")};
    auto src = GuestControl::open(u.path);
    auto guest = GuestControl::open(u.path); // the other side maps the same file
    REQUIRE(src.ok());
    REQUIRE(guest.ok());
    // Nobody attached: pause returns at once.
    CHECK((*src)->pause(std::chrono::milliseconds(10)).ok());
    (*src)->resume();

    std::atomic<bool> stop{false};
    std::atomic<uint64_t> writes{0};
    std::atomic<bool> writing{false};
    (*guest)->attach();
    std::thread g([&] {
        while (!stop) {
            (*guest)->check_pause(stop);
            writing = true; // a "page write" in flight
            writes++;
            writing = false;
        }
    });
    while (writes < 1000) {
        std::this_thread::yield();
    }
    REQUIRE((*src)->pause(std::chrono::seconds(5)).ok());
    CHECK_FALSE(writing.load()); // acknowledged between writes
    uint64_t frozen = writes;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(writes == frozen);
    (*src)->resume();
    while (writes < frozen + 1000) {
        std::this_thread::yield();
    }
    (*src)->set_throttle(150);
    CHECK((*guest)->throttle() == 99);
    // A pause wait ends when the guest is told to stop.
    REQUIRE((*src)->pause(std::chrono::seconds(5)).ok());
    stop = true;
    g.join();
    (*guest)->detach();
    CHECK_FALSE((*src)->guest_attached());
}
