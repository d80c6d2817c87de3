#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
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
    auto [path, write_path] = GENERATE(table<PageAccess, PageAccess>(
        {{PageAccess::File, PageAccess::File},
         {PageAccess::Mapped, PageAccess::Mapped},
         {PageAccess::File, PageAccess::Fill}}));
    Unlink u{shm_path("img")};
    auto img = RamImage::open(u.path, 8 * TARGET_PAGE_SIZE);
    REQUIRE(img.ok());
    RamImage &r = **img;
    r.set_page_paths(PagePaths{path, write_path, PageAccess::File, {}, "test"});
    REQUIRE(r.page_paths().write == write_path); // /dev/shm can be filled
    CHECK(r.backing().kind == BackingKind::Tmpfs);
    CHECK(r.pages() == 8);
    r.host(3 * TARGET_PAGE_SIZE)[5] = 9;
    r.scan_holes();
    CHECK(r.known_zero(0));
    CHECK_FALSE(r.known_zero(3));
    CHECK(r.known_zero_word(0) == 0xf7);
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
    if (path == PageAccess::File) {
        CHECK_FALSE(r.read(8 * TARGET_PAGE_SIZE, back.data(), 1).ok()); // past the end
    }

    // QEMU's memory-backend-file rules: a larger file is used for its first
    // `size` bytes, a smaller non-empty one is refused, never grown.
    auto smaller = RamImage::open(u.path, 4 * TARGET_PAGE_SIZE);
    REQUIRE(smaller.ok());
    CHECK((*smaller)->size() == 4 * TARGET_PAGE_SIZE);
    auto larger = RamImage::open(u.path, 16 * TARGET_PAGE_SIZE);
    REQUIRE_FALSE(larger.ok());
    CHECK(larger.error().message().find("too small") != std::string::npos);
    struct stat st;
    REQUIRE(stat(u.path.c_str(), &st) == 0);
    CHECK(st.st_size == 8 * TARGET_PAGE_SIZE);
    CHECK_FALSE(RamImage::open(u.path, 4097).ok()); // not page aligned
    auto again = RamImage::open(u.path, 0);          // size from the file
    REQUIRE(again.ok());
    CHECK((*again)->size() == 8 * TARGET_PAGE_SIZE);
    CHECK_FALSE(RamImage::open("/dev/shm/qmigd-unit-missing-dir/x", 0).ok());
}

TEST_CASE("RAM image: page batches move the same bytes on both paths", "[ram_image]")
{
    auto [path, write_path] = GENERATE(table<PageAccess, PageAccess>(
        {{PageAccess::File, PageAccess::File},
         {PageAccess::Mapped, PageAccess::Mapped},
         {PageAccess::File, PageAccess::Fill}}));
    Unlink u{shm_path("batch")};
    auto img = RamImage::open(u.path, 64 * TARGET_PAGE_SIZE);
    REQUIRE(img.ok());
    RamImage &r = **img;
    r.set_page_paths(PagePaths{path, write_path, PageAccess::File, {}, "test"});
    REQUIRE(r.page_paths().write == write_path);
    for (uint64_t pg : {2, 3, 4, 10, 40}) {
        std::memset(r.host(pg * TARGET_PAGE_SIZE), int(pg), TARGET_PAGE_SIZE);
    }
    r.scan_holes();
    // Source: data pages come back with their bytes, holes as the zero page.
    uint64_t offs[] = {2 * TARGET_PAGE_SIZE, 3 * TARGET_PAGE_SIZE, 4 * TARGET_PAGE_SIZE,
                       5 * TARGET_PAGE_SIZE, 40 * TARGET_PAGE_SIZE};
    std::vector<uint8_t> buf(5 * TARGET_PAGE_SIZE);
    const uint8_t *where[5];
    REQUIRE(r.load_pages(offs, 5, buf.data(), where).ok());
    CHECK(where[0][0] == 2);
    CHECK(where[2][4095] == 4);
    CHECK(where[3] == RamImage::zero_data());
    CHECK(where[4][100] == 40);
    // Pages the guest writes later are no holes any more.
    r.forget_holes(0, uint64_t(1) << 5);
    CHECK_FALSE(r.known_zero(5));
    CHECK(r.known_zero(6));

    // Destination: data received where prepare_pages says, then committed.
    uint64_t in[] = {20 * TARGET_PAGE_SIZE, 21 * TARGET_PAGE_SIZE, 30 * TARGET_PAGE_SIZE};
    struct iovec iov[3];
    int niov = 0;
    std::vector<uint8_t> rbuf(3 * TARGET_PAGE_SIZE);
    REQUIRE(r.prepare_pages(in, 3, rbuf.data(), iov, &niov).ok());
    CHECK(niov == 2); // pages 20-21 are one run
    uint8_t v = 0x60;
    for (int i = 0; i < niov; i++) {
        std::memset(iov[i].iov_base, v++, iov[i].iov_len);
    }
    REQUIRE(r.commit_pages(in, 3, rbuf.data()).ok());
    CHECK(r.host(21 * TARGET_PAGE_SIZE + 4095)[0] == 0x60);
    CHECK(r.host(30 * TARGET_PAGE_SIZE)[0] == 0x61);
    CHECK_FALSE(r.known_zero(20));
    CHECK_FALSE(r.known_zero(30));

    // A run over pages the file holds and a page it does not (a fill meets
    // EEXIST mid-run and overwrites those in place).
    uint64_t over[] = {3 * TARGET_PAGE_SIZE, 4 * TARGET_PAGE_SIZE, 5 * TARGET_PAGE_SIZE,
                       6 * TARGET_PAGE_SIZE};
    std::vector<uint8_t> obuf(4 * TARGET_PAGE_SIZE);
    REQUIRE(r.prepare_pages(over, 4, obuf.data(), iov, &niov).ok());
    CHECK(niov == 1);
    std::memset(iov[0].iov_base, 0x71, iov[0].iov_len);
    REQUIRE(r.commit_pages(over, 4, obuf.data()).ok());
    for (uint64_t pg = 3; pg <= 6; pg++) {
        CHECK(r.host(pg * TARGET_PAGE_SIZE)[0] == 0x71);
        CHECK(r.host(pg * TARGET_PAGE_SIZE + 4095)[0] == 0x71);
    }
    CHECK(r.host(2 * TARGET_PAGE_SIZE)[0] == 2);
    CHECK(r.host(7 * TARGET_PAGE_SIZE)[0] == 0);
    // A page punched out by a zero page and received again.
    REQUIRE(r.zero_page(4 * TARGET_PAGE_SIZE).ok());
    CHECK(r.host(4 * TARGET_PAGE_SIZE)[9] == 0);
    std::memset(obuf.data(), 0x72, TARGET_PAGE_SIZE);
    REQUIRE(r.write(4 * TARGET_PAGE_SIZE, obuf.data(), TARGET_PAGE_SIZE).ok());
    CHECK(r.host(4 * TARGET_PAGE_SIZE)[9] == 0x72);
    CHECK(r.host(5 * TARGET_PAGE_SIZE)[9] == 0x71);
    // One held page of a held run: its neighbours keep their bytes.
    std::memset(obuf.data(), 0x73, TARGET_PAGE_SIZE);
    REQUIRE(r.write(20 * TARGET_PAGE_SIZE, obuf.data(), TARGET_PAGE_SIZE).ok());
    CHECK(r.host(20 * TARGET_PAGE_SIZE + 4095)[0] == 0x73);
    CHECK(r.host(21 * TARGET_PAGE_SIZE)[0] == 0x60);
}

TEST_CASE("RAM image: a fill where none can be had writes as the paths say", "[ram_image]")
{
    // /var/tmp is a disk file system here: no userfaultfd fill there.
    Unlink u{"/var/tmp/qmigd-unit-nofill-" + std::to_string(getpid())};
    auto img = RamImage::open(u.path, 8 * TARGET_PAGE_SIZE);
    REQUIRE(img.ok());
    RamImage &r = **img;
    if (r.backing().can_fill()) {
        WARN("skipped: /var/tmp is shmem on this machine");
        return;
    }
    r.set_page_paths(PagePaths{PageAccess::File, PageAccess::Fill, PageAccess::File, {}, "test"});
    CHECK(r.page_paths().write == PageAccess::File);
    CHECK(r.page_paths().why.find("no fill path") != std::string::npos);
    std::vector<uint8_t> page(TARGET_PAGE_SIZE, 0x5a);
    REQUIRE(r.write(3 * TARGET_PAGE_SIZE, page.data(), page.size()).ok());
    CHECK(r.host(3 * TARGET_PAGE_SIZE)[7] == 0x5a);
}

TEST_CASE("page path: measured on /dev/shm, with a side file beside the image", "[page_path]")
{
    Backing b;
    b.kind = BackingKind::Tmpfs;
    PagePathCosts c = measure_page_paths("/dev/shm", b, 1 << 20);
    CHECK(c.pread_ns > 0);
    CHECK(c.map_read_ns > 0);
    CHECK(c.pwrite_ns > 0);
    CHECK(c.map_write_ns > 0);
    CHECK(c.fill_ns > 0); // shmem can be filled
    PagePaths forced = choose_page_paths("/dev/shm", b, PagePathMode::Mapped, true);
    CHECK(forced.read == PageAccess::Mapped);
    b.kind = BackingKind::Hugetlbfs;
    PagePaths file = choose_page_paths("/dev/shm", b, PagePathMode::File, true);
    CHECK(file.read == PageAccess::File);
    CHECK(file.write == PageAccess::Mapped); // hugetlbfs takes no pwrite
    // A forced fill only on shmem; elsewhere, and where it fails, writes
    // go as the backing wants them (no pwrite on a huge-page tmpfs).
    PagePaths fill = choose_page_paths("/dev/shm", b, PagePathMode::Fill, true);
    CHECK(fill.write == PageAccess::Mapped);
    CHECK(fill.why.find("no fill") != std::string::npos);
    b.kind = BackingKind::TmpfsHuge;
    fill = choose_page_paths("/dev/shm", b, PagePathMode::Fill, true);
    CHECK(fill.write == PageAccess::Fill);
    CHECK(fill.write_without_fill == PageAccess::Mapped);
    b.kind = BackingKind::Other;
    fill = choose_page_paths("/var/tmp", b, PagePathMode::Fill, true);
    CHECK(fill.write == PageAccess::File);
    CHECK(choose_page_paths("/dev/shm", b, PagePathMode::Fill, false).write == PageAccess::File);
    b.kind = BackingKind::Hugetlbfs;
    CHECK(side_file_path("/mnt/h/vm.ram", b, ".dirty") == "/dev/shm/qmigd_mnt_h_vm.ram.dirty");
    b.kind = BackingKind::Tmpfs;
    CHECK(side_file_path("/dev/shm/vm.ram", b, ".ctl") == "/dev/shm/vm.ram.ctl");
    PagePathMode m;
    CHECK(page_path_mode_parse("mapped", &m));
    CHECK(m == PagePathMode::Mapped);
    CHECK_FALSE(page_path_mode_parse("mmap", &m));
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
    // Opened again for another size: refused, and the mapped file keeps its
    // size (a resize would SIGBUS the processes that map it).
    auto other = DirtyBitmap::open(u.path, 1000);
    REQUIRE_FALSE(other.ok());
    CHECK(other.error().message().find("has 24 bytes where 128 are expected") !=
          std::string::npos);
    b.set_dirty(100);
    auto same = DirtyBitmap::open(u.path, 130);
    CHECK(same.ok());
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
    // A window to watch for a write that should not come (no event marks
    // its absence); a defect shows as a failure, a slow machine cannot.
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
