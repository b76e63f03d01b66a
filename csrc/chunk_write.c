/* Chunk files written in one call, one pipeline per chunk: payload and its
 * CRC32C, the header with that CRC, LRU clock. Each chunk goes through its
 * steps while the others are still being written, instead of the whole
 * batch waiting at each step with Python in between; on a 2 MiB chunk the
 * steps around the payload write are a fifth of its time. Policy
 * (reservations, renames into place, what a failure means) stays with the
 * caller. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <stdint.h>
#include <time.h>

#include "fxio.h"

#define FX_FUSED_WRITE_MAX (8u << 20) /* largest payload written in one request with its header */
/* Larger payloads go in segments of at least this size, each checksummed
 * just before its write (7 x 64 MiB and 47 x 10 MiB stores on the XFS loop:
 * 1.1-1.4x against writing the payload whole and checksumming it after;
 * 2 MiB did better than 4 or 8 MiB). */
#define FX_WRITE_SEGMENT (2u << 20)
/* A writer thread has one segment in flight, so a batch of fewer chunks than
 * this over FX_WRITE_SEGMENT gets larger segments: a lone 64 MiB chunk still
 * keeps 16 MiB in flight on a device with a long round trip (NVMe-oF), where
 * one whole write would be split by the block layer into requests all in
 * flight at once. */
#define FX_WRITE_IN_FLIGHT (16u << 20)

typedef struct {
    const fx_wchunk *c;
    fx_wchunk_result *out;
    int direct;
    uint64_t segment; /* bytes per segment of a large O_DIRECT payload */
} write_job;

static void put_le32(char *p, uint32_t v)
{
    p[0] = (char)(v & 0xff);
    p[1] = (char)((v >> 8) & 0xff);
    p[2] = (char)((v >> 16) & 0xff);
    p[3] = (char)(v >> 24);
}

/* The payload's CRC32C into the header, then the header's own. */
static void seal_header(char *hdr, uint32_t payload_crc)
{
    put_le32(hdr + FX_HDR_PCRC_OFF, payload_crc);
    put_le32(hdr + FX_HDR_CRC_OFF, fx_crc32c(0, hdr, FX_HDR_CRC_OFF));
}

/* A large O_DIRECT payload a segment at a time, each checksummed just
 * before it is written. Written whole and then checksummed, every writer
 * thread of a batch waited on the device together and then took its CRC
 * together, the device idle meanwhile; a segment at a time, some threads
 * checksum while others' segments are written, and each segment is still in
 * cache when it is copied out. Returns the bytes written or -errno. */
static int64_t write_segments(const fx_wchunk *c, uint64_t segment, uint32_t *crc)
{
    uint64_t done = 0;

    *crc = 0;
    while (done < c->length) {
        uint64_t k = c->length - done < segment ? c->length - done : segment;
        int64_t w;

        *crc = fx_crc32c(*crc, c->src + done, k);
        w = fx_io_sync(c->fd, 1, 1, (char *)c->src + done, k, FX_HDR_SIZE + done);
        if (w != (int64_t)k)
            return w < 0 ? w : (int64_t)(done + (uint64_t)w);
        done += k;
    }
    return (int64_t)done;
}

static void write_one(void *ctx, size_t i)
{
    const write_job *j = ctx;
    const fx_wchunk *c = &j->c[i];
    fx_wchunk_result *r = &j->out[i];
    struct timespec ts[2];
    int aligned = j->direct && !(((uintptr_t)c->src | c->length) & (FX_DIO_ALIGN - 1));

    if (aligned && c->length <= FX_FUSED_WRITE_MAX) {
        /* Header and payload as one O_DIRECT request, so the CRC comes
         * first: each request is a wait on the device (a round trip on
         * NVMe-oF). 2 MiB stores on the XFS loop: ~1.05x, the same system
         * CPU per GB (the CRC, not the loop worker, now pulls the source
         * into cache). Not for large payloads: there the header's request
         * is noise, and a burst of CRCs before the writes took CPU from
         * loads running beside the store (fx-l2's 64 MiB loads while
         * storing: 1.06-1.39x fs_native's, against 1.46-1.71x with the CRC
         * after; docs/bench-repeats/loads-first/). */
        r->crc = fx_crc32c(0, c->src, c->length);
        seal_header(c->hdr, r->crc);
        r->nbytes = fx_write_fused(c->fd, c->hdr, c->src, c->length);
        if (r->nbytes != (int64_t)c->length)
            return;
        r->hdr = FX_HDR_SIZE;
    } else {
        if (aligned) {
            /* Blocks for the whole file first: the writer threads write their
             * chunks' segments at once, and a filesystem that allocates each
             * segment as it is written (XFS, for O_DIRECT) interleaves the
             * files, every chunk then in FX_WRITE_SEGMENT extents, its reads
             * cut into that many requests. Where the filesystem cannot
             * preallocate, the file is written as before. */
            if (fallocate(c->fd, 0, 0, (off_t)(FX_HDR_SIZE + c->length)) < 0 && errno == ENOSPC) {
                r->nbytes = -ENOSPC;
                return;
            }
            r->nbytes = write_segments(c, j->segment, &r->crc);
        } else {
            r->nbytes = fx_io_sync(c->fd, 1, j->direct, (char *)c->src, c->length, FX_HDR_SIZE);
            /* After the write: where the kernel copied the source (buffered),
             * it may still be in this core's cache. */
            if (r->nbytes == (int64_t)c->length)
                r->crc = fx_crc32c(0, c->src, c->length);
        }
        if (r->nbytes != (int64_t)c->length)
            return;
        seal_header(c->hdr, r->crc);
        r->hdr = fx_io_sync(c->fd, 1, j->direct, c->hdr, FX_HDR_SIZE, 0);
        if (r->hdr != (int64_t)FX_HDR_SIZE)
            return;
    }
    if (c->mtime_ns <= 0)
        return;
    ts[0].tv_sec = ts[1].tv_sec = (time_t)(c->mtime_ns / 1000000000);
    ts[0].tv_nsec = ts[1].tv_nsec = (long)(c->mtime_ns % 1000000000);
    r->clock = futimens(c->fd, ts) < 0 ? -errno : 1;
}

int fx_chunks_write(const fx_wchunk *c, size_t n, int direct, struct fx_pool *pool, int width,
                    fx_wchunk_result *out)
{
    write_job j = {.c = c, .out = out, .direct = direct, .segment = FX_WRITE_SEGMENT};
    size_t writers = pool && n > 1 && width > 1 ? ((size_t)width < n ? (size_t)width : n) : 1;
    int r = 0;

    /* Too few writers to keep FX_WRITE_IN_FLIGHT in flight: larger segments,
     * still a multiple of FX_WRITE_SEGMENT (so 4 KiB-aligned). */
    if (writers * FX_WRITE_SEGMENT < FX_WRITE_IN_FLIGHT)
        j.segment = FX_WRITE_IN_FLIGHT / writers / FX_WRITE_SEGMENT * FX_WRITE_SEGMENT;

    memset(out, 0, n * sizeof(*out));
    fx_chunk_writes_running++;
    if (writers > 1) {
        r = fx_pool_parallel(pool, n, write_one, &j, width);
    } else {
        for (size_t i = 0; i < n; i++)
            write_one(&j, i);
    }
    fx_chunk_writes_running--;
    return r;
}
