// Parking: the loader's park mode (blocks from the stream, device state
// kept whole), the device-state record's check, and the parked VM
// directory's record.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "tests/unit/fake_loader.h"
#include "daemon/park/parked_vm.h"
#include "protocol/device_state.h"
#include "protocol/iterable_state.h"
#include "protocol/loadvm.h"
#include "protocol/savevm.h"

using namespace qmigd;

std::vector<uint8_t> loadvm_test_good_stream(uint8_t fill);

namespace {

using ParkRam = FakeLoader; // pages checked against the announced blocks

Result<LoadvmResult> park(const std::vector<uint8_t> &bytes, ParkRam &ram)
{
    LoadvmConfig cfg;
    cfg.machine_type = "something-else"; // park mode takes any machine
    cfg.park = true;
    MemoryInputStream in(bytes.data(), bytes.size());
    QEMUFileReader f(in, 64);
    return qemu_loadvm_state(f, cfg, ram);
}

// Where the device sections start: the timer's FULL section header.
size_t devices_at(const std::vector<uint8_t> &s)
{
    const uint8_t pat[] = {QEMU_VM_SECTION_FULL, 0, 0, 0, 0, 5, 't', 'i', 'm', 'e', 'r'};
    auto it = std::search(s.begin(), s.end(), std::begin(pat), std::end(pat));
    REQUIRE(it != s.end());
    return size_t(it - s.begin());
}

std::string park_error(const std::vector<uint8_t> &bytes)
{
    ParkRam ram;
    auto r = park(bytes, ram);
    REQUIRE_FALSE(r.ok());
    return r.error().message();
}

} // namespace

TEST_CASE("park mode takes the stream's blocks and keeps its device state whole", "[park]")
{
    auto s = loadvm_test_good_stream(0x5A);
    ParkRam ram;
    auto r = park(s, ram);
    REQUIRE(r.ok());
    CHECK(ram.announcements == 1);
    REQUIRE(ram.announced.size() == 1);
    CHECK(ram.announced[0].idstr == "mem");
    CHECK(r->machine_type == "none");
    CHECK(r->ram_section_id == 1);
    CHECK(r->normal_pages == 1);
    size_t at = devices_at(s);
    CHECK(r->device_state == std::vector<uint8_t>(s.begin() + long(at), s.end()));
    CHECK(device_state_check(r->device_state).ok());
}

TEST_CASE("park mode refuses streams it could not give back whole", "[park]")
{
    auto s = loadvm_test_good_stream(1);
    SECTION("cut inside the device state")
    {
        s.resize(s.size() - 3);
        CHECK(park_error(s) == "device state does not end with QEMU_VM_EOF and a VM description: "
                               "the stream was cut short");
    }
    SECTION("a device section before the end of RAM")
    {
        size_t at = devices_at(s);
        const uint8_t ram[] = {QEMU_VM_SECTION_START, 0, 0, 0, 1, 3, 'r', 'a', 'm'};
        auto start = std::search(s.begin(), s.end(), std::begin(ram), std::end(ram));
        std::vector<uint8_t> bad(s.begin(), start); // header + configuration
        bad.insert(bad.end(), s.begin() + long(at), s.end());
        CHECK(park_error(bad).find("a device section came before the end of RAM") == 0);
    }
    SECTION("the same block twice, or a length that is no whole pages")
    {
        std::vector<uint8_t> out;
        ByteWriter w(out);
        savevm_put_header(w);
        savevm_put_configuration(w, "pc-q35-10.0");
        savevm_put_section_header(w, QEMU_VM_SECTION_START, 2, "ram", 0, 4);
        auto twice = out;
        RamBlockDesc a[] = {{"pc.ram", 1 << 20}, {"pc.ram", 1 << 20}};
        ByteWriter w2(twice);
        ram_put_mem_size(w2, a);
        CHECK(park_error(twice) == "RAM block \"pc.ram\" announced twice");
        RamBlockDesc odd[] = {{"pc.bios", 1000}, {"pc.rom", 2 * 4096 - 1000}}; // whole total
        ram_put_mem_size(w, odd);
        CHECK(park_error(out) == "RAM block \"pc.bios\" has a bad length 0x3e8");
    }
}

TEST_CASE("a device-state record must end with EOF and a VM description", "[park]")
{
    auto s = loadvm_test_good_stream(1);
    std::vector<uint8_t> ds(s.begin() + long(devices_at(s)), s.end());
    auto ok = device_state_check(ds);
    REQUIRE(ok.ok());
    CHECK(ok->sections_bytes + 1 + 5 + ok->vmdesc_bytes == ds.size());
    for (size_t cut : {size_t(1), size_t(2), ok->vmdesc_bytes, ok->vmdesc_bytes + 5}) {
        std::vector<uint8_t> t(ds.begin(), ds.end() - long(cut));
        CHECK_FALSE(device_state_check(t).ok());
    }
    auto longer = ds;
    longer.push_back('}');
    CHECK_FALSE(device_state_check(longer).ok());
    auto nofull = ds;
    nofull[0] = QEMU_VM_SECTION_PART;
    CHECK(device_state_check(nofull).error().message() ==
          "device state does not start with a device section");
    CHECK_FALSE(device_state_check({}).ok());
}

namespace {

// What parked_vm_read() makes of a written record, once images of the
// recorded sizes stand next to it.
Result<ParkedVm> read_back_with_images(const ParkedVm &vm)
{
    for (size_t i = 0; i < vm.blocks.size(); i++) {
        std::filesystem::path p = parked_block_path(vm.dir, i, vm.blocks[i].idstr);
        std::ofstream(p).close();
        std::filesystem::resize_file(p, vm.blocks[i].size);
    }
    return parked_vm_read(vm.dir);
}

} // namespace

TEST_CASE("a parked VM's directory: names, record round trip and checks", "[park]")
{
    CHECK(parked_block_path("/d", 1, "/rom@etc/acpi/tables") == "/d/01-_rom_etc_acpi_tables.img");
    CHECK(parked_block_path("/d", 0, "../x") == "/d/00-.._x.img");
    namespace fs = std::filesystem;
    fs::path dir = fs::temp_directory_path() / ("qmigd-park-unit-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directory(dir);
    auto s = loadvm_test_good_stream(1);
    ParkedVm vm;
    vm.dir = dir.string();
    vm.machine_type = "pc-q35-10.0";
    vm.ram_section_id = 7;
    vm.blocks = {{"pc.ram", 8192}, {"pc.bios", 4096}};
    vm.device_state.assign(s.begin() + long(devices_at(s)), s.end());
    CHECK(park_dir_check(vm.dir).ok());
    REQUIRE(parked_vm_write(vm).ok());
    CHECK(park_dir_check(vm.dir).error().message() == "'" + vm.dir + "' already holds a parked VM");
    CHECK(parked_vm_read(vm.dir).error().message().find("No such file or directory") !=
          std::string::npos);
    auto back = read_back_with_images(vm);
    REQUIRE(back.ok());
    CHECK(back->machine_type == vm.machine_type);
    CHECK(back->ram_section_id == 7);
    CHECK(back->blocks.size() == 2);
    CHECK(back->blocks[1].idstr == "pc.bios");
    CHECK(back->device_state == vm.device_state);
    CHECK(parked_vm_ram_specs(*back)[0].path == parked_block_path(vm.dir, 0, "pc.ram"));
    fs::resize_file(parked_block_path(vm.dir, 1, "pc.bios"), 100);
    CHECK(parked_vm_read(vm.dir).error().message().find("is 100 bytes, the record says 4096") !=
          std::string::npos);
    fs::remove_all(dir);
}

namespace {

// A FULL section as QEMU writes one, with its footer.
void put_device(ByteWriter &w, uint32_t id, const std::string &name,
                const std::vector<uint8_t> &body)
{
    savevm_put_section_header(w, QEMU_VM_SECTION_FULL, id, name, 0, 1);
    w.bytes(body.data(), body.size());
    savevm_put_footer(w, id);
}

void put_vmdesc(ByteWriter &w, const std::string &desc)
{
    w.u8(QEMU_VM_EOF);
    w.u8(QEMU_VM_VMDESCRIPTION);
    w.be32(uint32_t(desc.size()));
    w.bytes(desc.data(), desc.size());
}

// Feeds `blob` to a DeviceStateEnd `step` bytes at a time; the prefix
// lengths at which it said the record was whole.
std::vector<size_t> ends_seen(const std::vector<uint8_t> &blob, size_t step)
{
    DeviceStateEnd end;
    std::vector<size_t> seen;
    for (size_t n = std::min(step, blob.size());; n = std::min(n + step, blob.size())) {
        if (end.whole(std::span(blob).first(n))) {
            seen.push_back(n);
        }
        if (n == blob.size()) {
            return seen;
        }
    }
}

// One read of a fake stream: what fits of src from `at` on.
ssize_t serve(const std::vector<uint8_t> &src, size_t at, void *dst, size_t n)
{
    size_t k = std::min(n, src.size() - at);
    std::memcpy(dst, src.data() + at, k);
    return ssize_t(k);
}

// The stream of a source that waits for our answer: its bytes, then a
// read that would never return (an error here, so the test sees it).
struct WaitingSource : InputStream {
    const std::vector<uint8_t> &bytes;
    size_t at = 0;
    explicit WaitingSource(const std::vector<uint8_t> &b) : bytes(b) {}
    ssize_t read_some(void *dst, size_t n, std::string *err) override
    {
        if (at == bytes.size()) {
            *err = "read past the end: the source waits for our SHUT";
            return -1;
        }
        ssize_t k = serve(bytes, at, dst, n);
        at += size_t(k);
        return k;
    }
};

// An unterminated dirty-bitmap section: BITS records of QEMU's largest
// chunk, for ever. Counts what it served.
struct EndlessBitmap : InputStream {
    std::vector<uint8_t> head, record;
    size_t served = 0;
    ssize_t read_some(void *dst, size_t n, std::string *) override
    {
        bool in_head = served < head.size();
        ssize_t k = serve(in_head ? head : record,
                          in_head ? served : (served - head.size()) % record.size(), dst, n);
        served += size_t(k);
        return k;
    }
};

} // namespace

TEST_CASE("a device state's end is found as it comes, where its description says", "[park]")
{
    // qmigd's own sections and QEMU 10's description of them (-M none).
    auto s = loadvm_test_good_stream(1);
    std::vector<uint8_t> ds(s.begin() + long(devices_at(s)), s.end());
    for (size_t step : {size_t(1), size_t(7), size_t(64), ds.size()}) {
        CHECK(ends_seen(ds, step) == std::vector<size_t>{ds.size()});
    }
    // Subsections with their headers, an array described by its first
    // element, a field of a nested struct; a footer-less section.
    std::vector<uint8_t> sub;
    ByteWriter w(sub);
    savevm_put_section_header(w, QEMU_VM_SECTION_FULL, 3, "dev", 2, 1);
    w.bytes(std::vector<uint8_t>(2 * 3 + 8, 0x11).data(), 14);
    w.u8(0x05);
    w.cstr8("dev/sub");
    w.be32(1);
    w.bytes(std::vector<uint8_t>(5, 0x22).data(), 5);
    put_vmdesc(w, R"({"page_size": 4096, "devices": [{"name": "dev", "instance_id": 2, )"
                  R"("fields": [{"name": "a", "array_len": 3, "size": 2}, {"name": "s", )"
                  R"("type": "struct", "struct": {"fields": [{"size": 4}]}, "size": 8}], )"
                  R"("subsections": [{"vmsd_name": "dev/sub", "version": 1, )"
                  R"("fields": [{"name": "x", "size": 5}]}]}]})");
    CHECK(ends_seen(sub, 1) == std::vector<size_t>{sub.size()});
    // A guest's bytes in a device buffer that look like a record's end are
    // not taken for it, wherever the reads end.
    std::vector<uint8_t> fake;
    ByteWriter fw(fake);
    std::string lure = R"({"page_size": 4096, "devices": []})";
    fw.u8(QEMU_VM_EOF);
    fw.u8(QEMU_VM_VMDESCRIPTION);
    fw.be32(uint32_t(lure.size()));
    fw.bytes(lure.data(), lure.size());
    std::vector<uint8_t> lured;
    ByteWriter lw(lured);
    put_device(lw, 4, "nic", fake);
    put_vmdesc(lw, fmt::format(R"({{"devices": [{{"name": "nic", "instance_id": 0, )"
                               R"("fields": [{{"size": {}}}]}}]}})",
                               fake.size()));
    CHECK(ends_seen(lured, 1) == std::vector<size_t>{lured.size()});
    // Descriptions that do not describe what came: other sizes, names,
    // instances, or something else than a description.
    auto nic = [&](const char *name, int instance, long size) {
        return fmt::format(R"({{"devices": [{{"name": "{}", "instance_id": {}, )"
                           R"("fields": [{{"size": {}}}]}}]}})",
                           name, instance, size);
    };
    const long body = long(fake.size());
    for (std::string bad : {nic("nic", 0, body - 1), nic("nic", 0, body + 1), nic("nix", 0, body),
                            nic("nic", 1, body), nic("nic", 0, -body), std::string(R"({"devices": {}})"),
                            std::string(R"({"nothing": 1})")}) {
        std::vector<uint8_t> t;
        ByteWriter tw(t);
        put_device(tw, 4, "nic", fake);
        put_vmdesc(tw, bad);
        CHECK(ends_seen(t, t.size()).empty());
    }
    // A postcopy package's sections under qmigd's own description.
    std::vector<uint8_t> pk;
    ByteWriter pw(pk);
    put_device(pw, 4, "nic", fake);
    size_t sections = pk.size();
    put_vmdesc(pw, device_state_packaged_vmdesc(sections));
    CHECK(ends_seen(pk, 3) == std::vector<size_t>{pk.size()});
    CHECK(device_state_check(pk).ok());
    CHECK_FALSE(device_state_described(std::span(pk).first(sections - 1),
                                       device_state_packaged_vmdesc(sections)));
}

TEST_CASE("park mode stops at a whole device state: the source waits for SHUT", "[park]")
{
    auto s = loadvm_test_good_stream(1);
    WaitingSource in(s);
    QEMUFileReader f(in, 64);
    LoadvmConfig cfg;
    cfg.park = true;
    ParkRam ram;
    auto r = qemu_loadvm_state(f, cfg, ram);
    REQUIRE(r.ok());
    CHECK(r->device_state == std::vector<uint8_t>(s.begin() + long(devices_at(s)), s.end()));
}

TEST_CASE("park mode refuses a stream with no RAM block list on every path", "[park]")
{
    std::vector<uint8_t> out;
    ByteWriter w(out);
    savevm_put_header(w);
    savevm_put_configuration(w, "pc-q35-10.0");
    auto precopy = out;
    ByteWriter pw(precopy);
    savevm_put_section_header(pw, QEMU_VM_SECTION_START, 1, "ram", 0, 4);
    ram_put_flag(pw, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(pw, 1);
    savevm_put_section_continue(pw, QEMU_VM_SECTION_END, 1);
    ram_put_flag(pw, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(pw, 1);
    savevm_put_timer(pw, 2);
    savevm_put_eof_and_vmdesc(pw);
    const std::string want = "the stream sent no RAM block list: qmigd cannot park this VM";
    CHECK(park_error(precopy) == want);
    // Postcopy: advised, then the package with the device state, no RAM.
    w.u8(QEMU_VM_COMMAND);
    w.be16(MIG_CMD_POSTCOPY_ADVISE);
    w.be16(16);
    w.be64(TARGET_PAGE_SIZE);
    w.be64(TARGET_PAGE_SIZE);
    std::vector<uint8_t> package;
    ByteWriter kw(package);
    savevm_put_command(kw, MIG_CMD_POSTCOPY_LISTEN);
    savevm_put_timer(kw, 2);
    savevm_put_command(kw, MIG_CMD_POSTCOPY_RUN);
    w.u8(QEMU_VM_COMMAND);
    w.be16(MIG_CMD_PACKAGED);
    w.be16(4);
    w.be32(uint32_t(package.size()));
    w.bytes(package.data(), package.size());
    w.u8(QEMU_VM_EOF);
    LoadvmConfig cfg;
    cfg.park = true;
    cfg.postcopy_ram = true;
    MemoryInputStream in(out.data(), out.size());
    QEMUFileReader f(in, 64);
    ParkRam ram;
    auto r = qemu_loadvm_state(f, cfg, ram);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().message() == want);
}

TEST_CASE("park mode bounds a dirty-bitmap section while it fills", "[park]")
{
    EndlessBitmap in;
    ByteWriter h(in.head);
    savevm_put_header(h);
    savevm_put_configuration(h, "none");
    savevm_put_section_header(h, QEMU_VM_SECTION_START, 1, "ram", 0, 4);
    RamBlockDesc mem{"mem", TARGET_PAGE_SIZE};
    ram_put_mem_size(h, std::span(&mem, 1));
    ram_put_flag(h, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(h, 1);
    savevm_put_section_header(h, QEMU_VM_SECTION_START, 2, "dirty-bitmap", 0, 1);
    ByteWriter r(in.record);
    r.u8(0x40); // BITS
    r.be64(0);
    r.be32(1);
    r.be64(10240);
    r.bytes(std::vector<uint8_t>(10240).data(), 10240);
    QEMUFileReader f(in, 64 * 1024);
    LoadvmConfig cfg;
    cfg.park = true;
    ParkRam ram;
    auto res = qemu_loadvm_state(f, cfg, ram);
    REQUIRE_FALSE(res.ok());
    CHECK(res.error().message().rfind("dirty-bitmap section: more than ", 0) == 0);
    CHECK(in.served < kMaxIterableState + (1 << 20));
}

TEST_CASE("a parked VM's record keeps any name QEMU sends, byte for byte", "[park]")
{
    namespace fs = std::filesystem;
    fs::path dir = fs::temp_directory_path() / ("qmigd-park-names-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directory(dir);
    auto s = loadvm_test_good_stream(1);
    ParkedVm vm;
    vm.dir = dir.string();
    vm.device_state.assign(s.begin() + long(devices_at(s)), s.end());
    // Nothing is written for a VM whose record would not read back.
    vm.machine_type = "pc";
    CHECK(parked_vm_write(vm).error().message().find("names no RAM block") != std::string::npos);
    CHECK(fs::is_empty(dir));
    vm.machine_type = std::string("pc-\xc3(", 5) + std::string(251, 'm');
    vm.blocks = {{std::string("pc.ram\xff\xfe", 8), 4096}, {"r\xc3\xa9m\n", 4096},
                 {std::string(255, '\x80'), 4096}, {"\xed\xa0\x80", 4096}, // a surrogate
                 {"\xc0\xaf", 4096}, {"\xf4\x90\x80\x80", 4096},           // overlong, > U+10FFFF
                 {"\xf0\x9f\x98\x80", 4096}};
    REQUIRE(parked_vm_write(vm).ok());
    std::ifstream rec(dir / "vm.json");
    std::string text((std::istreambuf_iterator<char>(rec)), std::istreambuf_iterator<char>());
    CHECK(text.find("\"machine-type-hex\": \"70632dc328") != std::string::npos);
    CHECK(text.find("\"idstr\": \"r\xc3\xa9m\\n\"") != std::string::npos);
    CHECK(text.find("\"idstr\": \"\xf0\x9f\x98\x80\"") != std::string::npos);
    for (const char *hex : {"eda080", "c0af", "f4908080"}) {
        CHECK(text.find(fmt::format("\"idstr-hex\": \"{}\"", hex)) != std::string::npos);
    }
    auto back = read_back_with_images(vm);
    REQUIRE(back.ok());
    CHECK(back->machine_type == vm.machine_type);
    REQUIRE(back->blocks.size() == vm.blocks.size());
    for (size_t i = 0; i < vm.blocks.size(); i++) {
        CHECK(back->blocks[i].idstr == vm.blocks[i].idstr);
    }
    for (std::string bad : {R"("machine-type-hex": "7")", R"("machine-type-hex": "zz")",
                            R"("machine-type-hex": 5)"}) {
        std::string t = R"({"format": "qmigd-parked-vm", "version": 1, "ram-section-id": 1, )" +
                        bad + R"(, "blocks": [{"idstr": "a", "size": 4096}]})";
        CHECK_FALSE(parked_vm_parse("/d", t).ok());
    }
    std::string both = R"({"format": "qmigd-parked-vm", "version": 1, "ram-section-id": 1, )"
                       R"("machine-type": "pc", "machine-type-hex": "7063", )"
                       R"("blocks": [{"idstr": "a", "size": 4096}]})";
    CHECK_FALSE(parked_vm_parse("/d", both).ok());
    fs::remove_all(dir);
}

TEST_CASE("vm.json is read through the QAPI visitor, in a QMP client's words", "[park]")
{
    auto error_of = [](const std::string &members) {
        std::string t = R"({"format": "qmigd-parked-vm", "version": 1, )" + members + "}";
        auto vm = parked_vm_parse("/d", t);
        return vm.ok() ? std::string() : vm.error().message();
    };
    const std::string ok_blocks = R"("blocks": [{"idstr": "a", "size": 4096}])";
    CHECK(error_of(R"("machine-type": "pc", "ram-section-id": 1, )" + ok_blocks).empty());
    CHECK(error_of(R"("machine-type": 5, "ram-section-id": 1, )" + ok_blocks) ==
          "'/d/vm.json': Invalid parameter type for 'machine-type', expected: string");
    CHECK(error_of(R"("machine-type": "pc", "ram-section-id": -1, )" + ok_blocks) ==
          "'/d/vm.json': Parameter 'ram-section-id' expects uint32_t");
    CHECK(error_of(R"("machine-type": "pc", )" + ok_blocks) ==
          "'/d/vm.json': Parameter 'ram-section-id' is missing");
    CHECK(error_of(R"("machine-type": "pc", "ram-section-id": 1, "blocks": [{"idstr": "a"}])") ==
          "'/d/vm.json': Parameter 'blocks[0].size' is missing");
    CHECK(error_of(R"("machine-type": "pc", "ram-section-id": 1, "blocks": [{"size": 4096, )"
                   R"("idstr": 1}])") ==
          "'/d/vm.json': Invalid parameter type for 'blocks[0].idstr', expected: string");
    CHECK(error_of(R"("machine-type": "pc", "ram-section-id": 1, "x": 1, )" + ok_blocks) ==
          "'/d/vm.json': Parameter 'x' is unexpected");
    // What the types cannot say is still checked after them.
    CHECK(error_of(R"("ram-section-id": 1, )" + ok_blocks).find("'machine-type' must be") !=
          std::string::npos);
    CHECK(error_of(R"("machine-type": "pc", "ram-section-id": 1, "uuid": "x", )" + ok_blocks)
              .find("'uuid' must be a UUID string") != std::string::npos);
}
