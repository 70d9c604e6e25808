/* svg.c - the pictures of docs/ (make docs), drawn from dpar's own schedules, traces and benchmark output.
   Build: cc -std=c99 -O2 -I. docs/gen/svg.c -o build/svg -pthread -lm
   Run:   build/svg              write every picture into docs/img/ (run from the repository's root)
          build/svg --check      make every picture in memory and compare it with the file in docs/img/

   Pictures, each from a source that a program of the repository made:
     ring.svg          lesson 3's ring allreduce on 4 ranks, what each rank holds after each step, in the lesson's
                       notation (chunk c of rank r starts as (c+1) * 10^r), from the run docs/guide/03_ring.md shows
     pipeline.svg      GPipe, 1F1B, interleaved 1F1B and ZB-H1 timelines of dpar_pipe_schedule_create, laid out by
                       dpar_pipe_schedule_format (its simulation: backward = 2 x forward; ZB-H1's B and W one unit
                       each), the bubble shaded
     zero_bubble.svg   lesson 16's 1F1B and ZB-H1 (4 stages, 8 micro-batches), B and W drawn apart
     v_schedules.svg   the V schedules ZB-V and DualPipeV (4 stages, 8 micro-batches, 2 chunks per stage in a V)
     dp_step.svg       one data-parallel step of docs/img/src/dp_step.trace.json, a DPAR_TRACE file that
                       docs/gen/dp_record.c recorded (make docs-record): backward per layer and the buckets'
                       allreduces on the progress threads
     tp.svg            a column-parallel then a row-parallel layer on 2 ranks and its two allreduces (tp_blocks)
     memory.svg        memory per rank, plain data parallelism against ZeRO-1/2/3: the formula with the parameter count
                       and the measured totals of docs/img/src/memory.txt (examples/fsdp.c and examples/zero.c output)
     moe.svg           lesson 14's MoE layer on 2 ranks: each token's two choices dispatched to its experts' ranks and
                       combined back, the dropped ones crossed, from the run docs/guide/14_expert_parallel.md shows
     context_parallel.svg  lesson 15's ring of K/V blocks on 4 ranks and the causal (query chunk, key chunk) blocks by
                       rank, zig-zag against contiguous shards, from the run docs/guide/15_context_parallel.md shows
     mixed_precision.svg  lesson 17's dynamic loss scale step by step (the skipped steps marked) and the losses of f16
                       compute against fp32, from the run docs/guide/17_mixed_precision.md shows
     clipping.svg      lesson 18's step 0 on 4 ranks: each shard's squares, the global norm's one coefficient against
                       the coefficients of clipping shard by shard, from the run docs/guide/18_accumulation_clipping.md
                       shows
     elastic.svg       lesson 19's checkpoint of 4 ranks loaded by 2: each unit's blocks before and after, and the
                       sampler's position in the epoch, from the run docs/guide/19_checkpoint_elastic.md shows
     bench_*.svg       one plot per family of bench= lines in docs/img/src/bench.txt (a make bench run)
   Each SVG opens with a comment naming its sources and their FNV-1a 64-bit hash (this file, plus the input files).
   --check fails for a picture whose stored hash differs from its sources' (a source changed; run make docs) and for
   one whose bytes differ from what this program makes now (dpar's schedules changed), and names any other SVG
   in docs/img/ (one that nothing makes any more). No time stamps: the same sources give the same bytes. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <dirent.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OUT_DIR "docs/img"
#define SRC_DIR "docs/img/src"
#define SELF "docs/gen/svg.c"
#define FONT "font-family=\"Helvetica,Arial,sans-serif\""

static int check_mode, problems;
static char made[64][48]; /* the pictures made so far (--check: any other SVG in docs/img is left over) */
static int nmade;

/* ---- a growing text buffer ---- */
typedef struct buf {
    char *s;
    size_t n, cap;
} buf;

static void bp(buf *b, const char *fmt, ...)
{
    va_list ap;
    int k;
    va_start(ap, fmt);
    k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (b->n + (size_t)k + 1 > b->cap) {
        b->cap = (b->n + (size_t)k + 1) * 2;
        b->s = (char *)realloc(b->s, b->cap);
        if (!b->s) exit((fprintf(stderr, "svg: out of memory\n"), 1));
    }
    va_start(ap, fmt);
    vsnprintf(b->s + b->n, (size_t)k + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t)k;
}

static char *slurp(const char *path, size_t *len) /* the whole file, NUL-terminated; NULL if it cannot be read */
{
    FILE *f = fopen(path, "rb");
    char *s = NULL;
    long n;
    if (!f) return NULL;
    if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (s = (char *)malloc((size_t)n + 1)) != NULL) {
        if (fread(s, 1, (size_t)n, f) != (size_t)n) {
            free(s);
            s = NULL;
        } else {
            s[n] = 0;
            if (len) *len = (size_t)n;
        }
    }
    fclose(f);
    return s;
}

static char *must_read(const char *path)
{
    char *s = slurp(path, NULL);
    if (!s) exit((fprintf(stderr, "svg: cannot read %s (run from the repository's root)\n", path), 1));
    return s;
}

/* FNV-1a, 64 bits, over each source's path and bytes */
static uint64_t fnv(uint64_t h, const char *s, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

/* ---- SVG pieces ---- */
/* a coordinate to one decimal, printed with %g: "84" rather than "84.0" (smaller files, the same picture) */
static double r1(double v) { return floor(v * 10 + 0.5) / 10; }

static void rect(buf *b, double x, double y, double w, double h, const char *fill)
{
    bp(b, "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"%s\" stroke=\"#333\" stroke-width=\".5\"/>\n",
       r1(x), r1(y), r1(w), r1(h), fill);
}
static void line(buf *b, double x1, double y1, double x2, double y2, const char *color, double width)
{
    bp(b, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"%s\" stroke-width=\"%g\"/>\n", r1(x1), r1(y1), r1(x2),
       r1(y2), color, r1(width));
}
static void text(buf *b, double x, double y, int size, char anchor, const char *fmt, ...)
{
    char s[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s, sizeof s, fmt, ap);
    va_end(ap);
    bp(b, "<text x=\"%g\" y=\"%g\" font-size=\"%d\" text-anchor=\"%s\">%s</text>\n", r1(x), r1(y), size,
       anchor == 'm'   ? "middle"
       : anchor == 'e' ? "end"
                       : "start",
       s);
}

/* write (or check) OUT_DIR/name: the header with the sources' hash, the body, the end */
static void emit(const char *name, int w, int h, buf *body, const char *const *sources)
{
    buf out = {0};
    uint64_t hash = 1469598103934665603ull;
    char path[512], *old;
    size_t i, n = 0;
    int k;
    bp(&out, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" %s>\n", w, h,
       w, h, FONT);
    bp(&out, "<!-- made by docs/gen/svg.c (make docs); do not edit. sources:");
    for (k = 0; sources[k]; k++) {
        char *s = slurp(sources[k], &n);
        if (!s) exit((fprintf(stderr, "svg: cannot read %s\n", sources[k]), 1));
        hash = fnv(hash, sources[k], strlen(sources[k]) + 1);
        hash = fnv(hash, s, n);
        free(s);
        bp(&out, " %s", sources[k]);
    }
    bp(&out, "; fnv1a64 %016llx -->\n", (unsigned long long)hash);
    bp(&out, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    bp(&out, "%s</svg>\n", body->s ? body->s : "");
    snprintf(path, sizeof path, "%s/%s", OUT_DIR, name);
    if (nmade < 64) snprintf(made[nmade++], sizeof made[0], "%s", name);
    if (check_mode) {
        const char *mark = "; fnv1a64 ";
        char *at;
        old = slurp(path, &n);
        at = old ? strstr(old, mark) : NULL;
        if (!old) {
            printf("missing  %s: run make docs\n", path);
            problems++;
        } else if (!at || strncmp(at, strstr(out.s, mark), strlen(mark) + 16) != 0) {
            printf(
                "STALE    %s: its sources changed since it was made (stored hash %.16s, now %016llx); run make docs\n",
                path, at ? at + strlen(mark) : "none", (unsigned long long)hash);
            problems++;
        } else if (n != out.n || memcmp(old, out.s, n) != 0) {
            for (i = 0; i < n && i < out.n && old[i] == out.s[i]; i++) {}
            printf("DIFFERS  %s: same sources, other bytes from byte %zu (dpar's schedules or ring changed?); run make "
                   "docs\n",
                   path, i);
            problems++;
        } else {
            printf("ok       %s\n", path);
        }
        free(old);
    } else {
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(out.s, 1, out.n, f) != out.n || fclose(f) != 0)
            exit((fprintf(stderr, "svg: cannot write %s\n", path), 1));
        printf("wrote %s (%zu bytes)\n", path, out.n);
    }
    free(out.s);
    free(body->s);
    body->s = NULL;
    body->n = body->cap = 0;
}

static const char *const blues[] = {"#ffffff", "#deebf7", "#9ecae1", "#4292c6", "#08519c"};

/* ==== (a) the ring: lesson 3's ring allreduce on 4 ranks, from the run docs/guide/03_ring.md shows ==== */
#define RING_PAGE "docs/guide/03_ring.md"
#define RN 4
#define RING_MOMENTS (2 * RN - 1) /* the start, RN - 1 reduce-scatter steps, RN - 1 all-gather steps */

/* The table the page's run prints: "start: ...", "reduce-scatter step k: ...", "all-gather step k: ..." each followed
   by RN lines "  rank r:  v v v v" (rank r's chunk c starts as (c+1) * 10^r, so a sum's digits say whose inputs it
   holds). Exits with a sentence when the page shows no such run. */
static void ring_read(int held[RING_MOMENTS][RN][RN])
{
    char *txt = must_read(RING_PAGE);
    char *ln;
    int moment = -1;
    int rows = 0;
    int in_run = 0;
    for (ln = strtok(txt, "\n"); ln; ln = strtok(NULL, "\n")) {
        int r, k;
        if (!strcmp(ln, "$ build/lesson03")) in_run = 1;
        if (!in_run) continue;
        if (!strncmp(ln, "start: ", 7)) {
            moment = 0;
        } else if (sscanf(ln, "reduce-scatter step %d:", &k) == 1) {
            moment = k;
        } else if (sscanf(ln, "all-gather step %d:", &k) == 1) {
            moment = RN - 1 + k;
        } else if (moment >= 0 && moment < RING_MOMENTS && sscanf(ln, "  rank %d:", &r) == 1 && r >= 0 && r < RN) {
            const char *at = strchr(ln, ':') + 1;
            int c;
            for (c = 0; c < RN; c++) held[moment][r][c] = (int)strtol(at, (char **)&at, 10);
            rows++;
            if (moment == RING_MOMENTS - 1 && r == RN - 1) break;
        }
    }
    free(txt);
    if (rows != RING_MOMENTS * RN)
        exit((fprintf(stderr, "svg: %s shows no 4-rank run (%d table rows, not %d)\n", RING_PAGE, rows,
                      RING_MOMENTS * RN),
              1));
}

static void ring_picture(void)
{
    static const char *const src[] = {SELF, RING_PAGE, NULL};
    static int held[RING_MOMENTS][RN][RN];
    int r, c, s;
    int cell = 36;
    int panel_width = RN * cell + 30;
    int x0 = 40;
    int y0 = 92;
    buf b = {0};
    ring_read(held);
    for (r = 0; r < RN; r++)
        for (c = 0; c < RN; c++)
            if (held[RING_MOMENTS - 1][r][c] != 1111 * (c + 1))
                exit((fprintf(stderr, "svg: %s: rank %d's chunk %d ends as %d, not the sum %d\n", RING_PAGE, r, c,
                              held[RING_MOMENTS - 1][r][c], 1111 * (c + 1)),
                      1));
    text(&b, 10, 22, 15, 's', "Ring allreduce on %d ranks: what each rank holds after each step (lesson 3's run)", RN);
    text(&b, 10, 40, 11, 's',
         "Rows: ranks; columns: chunks. Rank r's chunk c starts as (c+1) x 10^r, so each digit of a sum says whether "
         "one rank's input is in it:");
    text(&b, 10, 54, 11, 's',
         "3303 holds ranks 0, 2 and 3 (the tens digit, rank 1, is 0). Reduce-scatter step k: rank r adds chunk r-k "
         "(mod %d), received from rank r-1;",
         RN);
    text(&b, 10, 68, 11, 's',
         "all-gather step k: rank r keeps the finished chunk r-k+1 it receives from rank r-1. The framed cell is the "
         "one the step wrote.");
    for (s = 0; s < RING_MOMENTS; s++) {
        double px = x0 + s * panel_width;
        text(&b, px + RN * cell / 2.0, y0 - 6, 11, 'm',
             s == 0   ? "start"
             : s < RN ? "reduce-scatter %d"
                      : "all-gather %d",
             s < RN ? s : s - RN + 1);
        for (r = 0; r < RN; r++)
            for (c = 0; c < RN; c++) {
                int value = held[s][r][c];
                int ranks_in = 0;
                int v;
                for (v = value; v > 0; v /= 10) ranks_in += v % 10 != 0;
                rect(&b, px + c * cell, y0 + r * cell, cell, cell, blues[ranks_in]);
                bp(&b, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"middle\" fill=\"%s\">%d</text>\n",
                   px + c * cell + cell / 2.0, y0 + r * cell + cell / 2.0 + 4, ranks_in >= 3 ? "white" : "black",
                   value);
                if (s > 0 && held[s - 1][r][c] != value)
                    bp(&b,
                       "<rect x=\"%.1f\" y=\"%.1f\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#d62728\" "
                       "stroke-width=\"2\"/>\n",
                       px + c * cell + 1.0, y0 + r * cell + 1.0, cell - 2, cell - 2);
            }
    }
    for (r = 0; r < RN; r++) text(&b, x0 - 6, y0 + r * cell + cell / 2.0 + 4, 10, 'e', "r%d", r);
    for (c = 0; c < RN; c++) text(&b, x0 + c * cell + cell / 2.0, y0 + RN * cell + 14, 9, 'm', "c%d", c);
    text(&b, 10, y0 + RN * cell + 36, 11, 's',
         "From the run docs/guide/03_ring.md shows (examples/guide/03_ring.c, which checks it against dpar_allreduce "
         "and a serial sum); every rank ends with 1111 2222 3333 4444.");
    emit("ring.svg", x0 + RING_MOMENTS * panel_width, y0 + RN * cell + 48, &b, src);
}

/* ==== (b) pipeline timelines: dpar_pipe_schedule_format's layout ==== */
static void pipe_panel(buf *b, dpar_pipe_kind kind, int p, int m, int v, double y, double unit, double x0)
{
    dpar_pipe_schedule_desc d = {0};
    dpar_pipe_schedule *S;
    char *txt, *ln;
    size_t need;
    int s = 0, cells = 0, idle = 0, k;
    double scale = unit / v, rowh = 20;
    d.kind = kind, d.p = p, d.m = m, d.v = v;
    if (dpar_pipe_schedule_create(&d, &S) != DPAR_OK)
        exit((fprintf(stderr, "svg: dpar_pipe_schedule_create: %s\n", dpar_last_error()), 1));
    need = dpar_pipe_schedule_format(S, NULL, 0) + 1;
    txt = (char *)malloc(need);
    if (!txt) exit(1);
    dpar_pipe_schedule_format(S, txt, need);
    for (ln = strstr(txt, "\nstage "); ln; ln = strstr(ln + 1, "\nstage ")) {
        char *bar = strchr(ln, '|'), *end = bar ? strchr(bar + 1, '|') : NULL;
        double yy = y + 18 + s * rowh;
        if (!end) exit((fprintf(stderr, "svg: unexpected schedule layout:\n%s", txt), 1));
        cells = (int)(end - bar - 1) / 4;
        text(b, x0 - 6, yy + 14, 10, 'e', "stage %d", s);
        for (k = 0; k < cells; k++) {
            const char *c = bar + 1 + 4 * k;
            double xx = x0 + k * scale;
            if (c[0] == 'F' || c[0] == 'B' || c[0] == 'W') {
                int w = 1, micro = atoi(c + 1), chunk = v > 1 && c[2] >= 'a' ? c[2] - 'a' : 0;
                const char *fill = c[0] == 'F'   ? (chunk ? "#c6dbef" : "#9ecae1")
                                   : c[0] == 'B' ? (chunk ? "#fdd0a2" : "#fd8d3c")
                                                 : (chunk ? "#c7e9c0" : "#74c476");
                while (k + w < cells && strncmp(bar + 1 + 4 * (k + w), "====", 4) == 0) w++; /* the op's cells */
                rect(b, xx, yy, w * scale, rowh - 2, fill);
                if (v > 1) text(b, xx + w * scale / 2, yy + 13, 8, 'm', "%d%c", micro, 'a' + chunk);
                else text(b, xx + w * scale / 2, yy + 13, 9, 'm', "%d", micro);
            } else if (c[1] == '.') {
                rect(b, xx, yy, scale, rowh - 2, "#d9d9d9");
                idle++;
            }
        }
        s++;
    }
    if (s != p) exit((fprintf(stderr, "svg: %d stage lines in the layout, not %d:\n%s", s, p, txt), 1));
    if (fabs((double)idle / (p * cells) - S->bubble) > 1e-9) /* the picture must be the schedule's own bubble */
        exit((fprintf(stderr, "svg: %d idle cells of %d, but the schedule says bubble %.6f\n", idle, p * cells,
                      S->bubble),
              1));
    text(b, x0, y + 12, 12, 's', "%s: p=%d stages, m=%d micro-batches%s; bubble %.1f%% (%d idle cells of %d)",
         kind == DPAR_PIPE_GPIPE       ? "GPipe"
         : kind == DPAR_PIPE_1F1B      ? "1F1B"
         : kind == DPAR_PIPE_ZB_H1     ? "ZB-H1 (zero bubble)"
         : kind == DPAR_PIPE_ZBV       ? "ZB-V (zero bubble in a V)"
         : kind == DPAR_PIPE_DUALPIPEV ? "DualPipeV (DeepSeek's order, in a V)"
                                       : "interleaved 1F1B",
         p, m, v > 1 ? ", v=2 chunks per stage" : "", 100.0 * S->bubble, idle, p * cells);
    text(b, x0 + cells * scale + 8, y + 18 + p * rowh / 2 - 4, 10, 's', "stage 0 holds up to");
    text(b, x0 + cells * scale + 8, y + 18 + p * rowh / 2 + 10, 10, 's', "%d %sactivations", S->peak_stash[0],
         v > 1 ? "chunk " : "");
    free(txt);
    dpar_pipe_schedule_destroy(S);
}

static void pipeline_picture(void)
{
    static const char *const src[] = {SELF, NULL};
    buf b = {0};
    double unit = 24, x0 = 60, ph = 112;
    text(&b, 10, 22, 15, 's', "Pipeline schedules of dpar_pipe_schedule_create, 4 stages, 8 micro-batches");
    text(&b, 10, 40, 11, 's',
         "Blue: forward of micro-batch i; orange: backward (twice a forward; ZB-H1: its input half B); green: W; grey: "
         "idle (the bubble).");
    text(&b, 10, 54, 11, 's',
         "Interleaved: each stage holds 2 model chunks (a, b) of half the layers, so a chunk's cell is half as long.");
    pipe_panel(&b, DPAR_PIPE_GPIPE, 4, 8, 1, 66, unit, x0);
    pipe_panel(&b, DPAR_PIPE_1F1B, 4, 8, 1, 66 + ph, unit, x0);
    pipe_panel(&b, DPAR_PIPE_INTERLEAVED, 4, 8, 2, 66 + 2 * ph, unit, x0);
    pipe_panel(&b, DPAR_PIPE_ZB_H1, 4, 8, 1, 66 + 3 * ph, unit, x0);
    emit("pipeline.svg", 980, (int)(66 + 4 * ph), &b, src);
}

/* lesson 16: 1F1B against ZB-H1 on the lesson's default pipeline (4 stages, 8 micro-batches), B and W apart */
static void zero_bubble_picture(void)
{
    static const char *const src[] = {SELF, NULL};
    buf b = {0};
    double unit = 24, x0 = 60, ph = 112;
    text(&b, 10, 22, 15, 's', "1F1B against ZB-H1 (zero bubble), 4 stages, 8 micro-batches: lesson 16's schedules");
    text(&b, 10, 40, 11, 's',
         "Blue: forward; orange: a whole backward (1F1B) or its input half B (ZB-H1); green: W, the weights' half; "
         "grey: idle (the bubble).");
    text(&b, 10, 54, 11, 's',
         "ZB-H1 runs each B where 1F1B runs its backward and moves the W's into 1F1B's idle cells: (p-1)/(3m+p-1) "
         "against (p-1)/(m+p-1).");
    pipe_panel(&b, DPAR_PIPE_1F1B, 4, 8, 1, 66, unit, x0);
    pipe_panel(&b, DPAR_PIPE_ZB_H1, 4, 8, 1, 66 + ph, unit, x0);
    emit("zero_bubble.svg", 980, (int)(66 + 2 * ph), &b, src);
}

/* the V schedules: two chunks per stage placed as a V (stage s: chunks s and 2p - 1 - s), 4 stages, 8 micro-batches */
static void v_schedules_picture(void)
{
    static const char *const src[] = {SELF, NULL};
    buf b = {0};
    double unit = 24, x0 = 60, ph = 112;
    text(&b, 10, 22, 15, 's',
         "V schedules, 4 stages, 8 micro-batches, 2 chunks per stage (a: going down, b: coming up)");
    text(&b, 10, 40, 11, 's',
         "Stage s holds the model's pieces s (a) and 7 - s (b): the last stage turns a into b itself, the loss is on "
         "stage 0. Blue: F; orange: B; green: W; grey: idle.");
    text(
        &b, 10, 54, 11, 's',
        "A chunk is half a stage, so the last stage waits 3 half-forwards: bubble (p-1)/(6m+p-1) = 5.9% with F = B = W "
        "(ZB-H1: 11.1%, 1F1B: 27.3%).");
    pipe_panel(&b, DPAR_PIPE_ZBV, 4, 8, 2, 66, unit, x0);
    pipe_panel(&b, DPAR_PIPE_DUALPIPEV, 4, 8, 2, 66 + ph, unit, x0);
    emit("v_schedules.svg", 980, (int)(66 + 2 * ph), &b, src);
}

/* ==== (c) one data-parallel step from a DPAR_TRACE file ==== */
typedef struct span {
    char name[24];
    int tid, arg;
    double ts, dur; /* microseconds */
} span;

static double num_after(const char *s, const char *key, double dflt)
{
    const char *p = strstr(s, key);
    return p ? atof(p + strlen(key)) : dflt;
}

static void dp_picture(void)
{
    static const char *const src[] = {SELF, SRC_DIR "/dp_step.trace.json", NULL};
    char *txt = must_read(SRC_DIR "/dp_step.trace.json"), *ln, names[64][32];
    span *sp = NULL;
    int n = 0, cap = 0, i, r, last = -1, rank_tid[8], prog_tid[8], ranks = 0, nbuckets = 0, under = 0;
    double t0 = 1e300, t1 = 0, x0 = 120, width = 760, rowh = 22, y0 = 84, y;
    buf b = {0};
    memset(names, 0, sizeof names);
    for (ln = strtok(txt, "\n"); ln; ln = strtok(NULL, "\n")) {
        const char *q = strstr(ln, "\"name\":\"");
        int tid = (int)num_after(ln, "\"tid\":", -1);
        if (!q || tid < 0 || tid >= 64) continue;
        q += 8;
        if (strstr(ln, "\"ph\":\"M\"")) { /* thread_name: the track's name */
            const char *nm = strstr(ln, "\"args\":{\"name\":\"");
            if (nm) sscanf(nm + 16, "%31[^\"]", names[tid]);
            continue;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 256;
            sp = (span *)realloc(sp, (size_t)cap * sizeof *sp);
            if (!sp) exit(1);
        }
        memset(&sp[n], 0, sizeof sp[n]);
        sscanf(q, "%23[^\"]", sp[n].name);
        sp[n].tid = tid;
        sp[n].ts = num_after(ln, "\"ts\":", 0);
        sp[n].dur = num_after(ln, "\"dur\":", 0);
        sp[n].arg = (int)num_after(ln, "\"layer\":", -1);
        if (!strcmp(sp[n].name, "step") && sp[n].arg > last) last = sp[n].arg;
        n++;
    }
    for (i = 0; i < 8; i++) rank_tid[i] = prog_tid[i] = -1;
    for (i = 0; i < 64; i++) {
        int rk = -1;
        char tail[16] = "";
        if (names[i][0] && sscanf(names[i], "dp rank %d%15s", &rk, tail) >= 1 && rk >= 0 && rk < 8) {
            if (tail[0]) prog_tid[rk] = i;
            else rank_tid[rk] = i;
            if (rk + 1 > ranks) ranks = rk + 1;
        }
    }
    for (i = 0; i < n; i++) /* the window: the last step of every rank */
        if (!strcmp(sp[i].name, "step") && sp[i].arg == last) {
            if (sp[i].ts < t0) t0 = sp[i].ts;
            if (sp[i].ts + sp[i].dur > t1) t1 = sp[i].ts + sp[i].dur;
        }
    if (last < 0 || ranks == 0 || t1 <= t0) exit((fprintf(stderr, "svg: no step spans in the trace\n"), 1));
    for (r = 0; r < ranks; r++) /* the buckets of the step: how many began while their rank's backward ran */
        for (i = 0; i < n; i++) {
            int k;
            if (sp[i].tid != prog_tid[r] || strcmp(sp[i].name, "allreduce") || sp[i].ts < t0 || sp[i].ts >= t1)
                continue;
            nbuckets++;
            for (k = 0; k < n; k++)
                if (sp[k].tid == rank_tid[r] && !strcmp(sp[k].name, "backward") && sp[k].ts >= t0 &&
                    sp[k].ts <= sp[i].ts && sp[i].ts < sp[k].ts + sp[k].dur) {
                    under++;
                    break;
                }
        }
    if (under == 0) exit((fprintf(stderr, "svg: no bucket of the traced step began under backward\n"), 1));
    text(&b, 10, 22, 15, 's',
         "One data-parallel step of %d thread ranks, from a DPAR_TRACE file (step %d of a real run)", ranks, last + 1);
    text(&b, 10, 40, 11, 's',
         "Each rank computes backward layer by layer (L5 first); as soon as a layer's gradient is final its bucket's "
         "allreduce");
    text(&b, 10, 54, 11, 's',
         "runs on the rank's progress thread, under the backward of the layers below (here %d of the step's %d "
         "allreduces began under backward).",
         under, nbuckets);
    text(&b, 10, 68, 11, 's',
         "Recorded by docs/gen/dp_record.c (make docs-record) into docs/img/src/dp_step.trace.json, on a shared "
         "2-core machine.");
    y = y0;
    for (r = 0; r < ranks; r++) {
        int pass;
        for (pass = 0; pass < 2; pass++) {
            int tid = pass ? prog_tid[r] : rank_tid[r];
            text(&b, x0 - 8, y + 15, 10, 'e', pass ? "rank %d progress" : "rank %d", r);
            line(&b, x0, y + rowh - 1, x0 + width, y + rowh - 1, "#eeeeee", 1);
            for (i = 0; i < n && tid >= 0; i++) {
                double a = sp[i].ts, e = sp[i].ts + sp[i].dur, xa, xe;
                const char *fill = NULL, *lab = "";
                char l[8] = "";
                if (sp[i].tid != tid || e <= t0 || a >= t1) continue;
                if (a < t0) a = t0;
                if (e > t1) e = t1;
                if (!strcmp(sp[i].name, "forward")) fill = "#9ecae1", lab = "forward";
                else if (!strcmp(sp[i].name, "backward")) fill = "#fd8d3c", snprintf(l, sizeof l, "L%d", sp[i].arg);
                else if (!strcmp(sp[i].name, "wait")) fill = "#d9d9d9", lab = "wait";
                else if (!strcmp(sp[i].name, "sgd")) fill = "#a1d99b", lab = "sgd";
                else if (!strcmp(sp[i].name, "allreduce")) fill = "#9467bd";
                if (!fill) continue;
                xa = x0 + (a - t0) / (t1 - t0) * width, xe = x0 + (e - t0) / (t1 - t0) * width;
                rect(&b, xa, y + 2, xe - xa > 2 ? xe - xa : 2, rowh - 5, fill);
                if (l[0]) lab = l;
                if (xe - xa > 6.0 * (double)strlen(lab) + 4) text(&b, (xa + xe) / 2, y + 15, 9, 'm', "%s", lab);
            }
            y += rowh;
        }
        y += 6;
    }
    for (i = 0; i <= 4; i++) {
        double xx = x0 + i * width / 4;
        line(&b, xx, y, xx, y + 4, "#333", 1);
        text(&b, xx, y + 16, 10, 'm', "%.1f ms", (t1 - t0) / 1000.0 * i / 4);
    }
    rect(&b, x0, y + 26, 12, 10, "#9467bd");
    text(&b, x0 + 16, y + 35, 10, 's', "a bucket's allreduce (dpar's own span)");
    rect(&b, x0 + 240, y + 26, 12, 10, "#fd8d3c");
    text(&b, x0 + 256, y + 35, 10, 's', "backward of layer l");
    rect(&b, x0 + 400, y + 26, 12, 10, "#d9d9d9");
    text(&b, x0 + 416, y + 35, 10, 's', "dpar_buckets_wait");
    emit("dp_step.svg", (int)(x0 + width + 20), (int)(y + 46), &b, src);
    free(sp);
    free(txt);
}

/* ==== (d) tensor parallelism: a column-parallel then a row-parallel layer on 2 ranks ==== */
static const struct tp_block {
    int lane;          /* 0, 1: rank; 2: spans both */
    double col, w;     /* column and width in grid units */
    const char *fill;  /* colour */
    const char *label; /* two lines split by '|' */
} tp_blocks[] = {
    {2, 0, 1.2, "#ffffff", "X (B, d)|on every rank"},       {2, 1.5, 1.3, "#fdd0a2", "f: identity|bwd: allreduce"},
    {0, 3.1, 1.4, "#9ecae1", "X A_0|columns 0..h/2"},       {1, 3.1, 1.4, "#9ecae1", "X A_1|columns h/2..h"},
    {0, 4.8, 1.0, "#ffffff", "GeLU|Y_0 (B, h/2)"},          {1, 4.8, 1.0, "#ffffff", "GeLU|Y_1 (B, h/2)"},
    {0, 6.1, 1.4, "#a1d99b", "Y_0 B_0|rows 0..h/2"},        {1, 6.1, 1.4, "#a1d99b", "Y_1 B_1|rows h/2..h"},
    {2, 7.8, 1.3, "#fdd0a2", "g: allreduce|bwd: identity"}, {2, 9.4, 1.2, "#ffffff", "Z (B, d)|on every rank"},
};

static void tp_picture(void)
{
    static const char *const src[] = {SELF, NULL};
    buf b = {0};
    double gx = 70, x0 = 20, y0 = 80, laneh = 56, bh = 40;
    size_t i, next;
    text(&b, 10, 22, 15, 's',
         "Tensor parallelism (Megatron): a column-parallel layer, then a row-parallel one, 2 ranks");
    text(&b, 10, 40, 11, 's',
         "A (d x h) is cut by columns, B (h x d) by rows: Y_r = GeLU(X A_r) needs no communication, Z = Y_0 B_0 + Y_1 "
         "B_1 "
         "is one allreduce (g)");
    text(&b, 10, 54, 11, 's',
         "in forward; in backward the gradient of X is one allreduce (f). dpar_linear_forward/_backward, "
         "docs/model_parallel.md.");
    text(&b, x0, y0 + laneh / 2 + 4, 11, 's', "rank 0");
    text(&b, x0, y0 + laneh * 1.5 + 4, 11, 's', "rank 1");
    for (i = 0; i < sizeof tp_blocks / sizeof tp_blocks[0]; i++) {
        const struct tp_block *t = &tp_blocks[i];
        double x = x0 + 40 + t->col * gx, w = t->w * gx, y = y0 + (t->lane == 1 ? laneh : 0) + (laneh - bh) / 2;
        double h = t->lane == 2 ? laneh + bh : bh;
        char first[40], second[40] = "";
        const char *bar = strchr(t->label, '|');
        snprintf(first, sizeof first, "%.*s", bar ? (int)(bar - t->label) : 39, t->label);
        if (bar) snprintf(second, sizeof second, "%s", bar + 1);
        rect(&b, x, y, w, h, t->fill);
        text(&b, x + w / 2, y + h / 2 - 2, 11, 'm', "%s", first);
        text(&b, x + w / 2, y + h / 2 + 12, 9, 'm', "%s", second);
        next = i + 1; /* the next column's first block: rank 0's block skips rank 1's in its own column */
        while (next < sizeof tp_blocks / sizeof tp_blocks[0] && tp_blocks[next].col == t->col) next++;
        if (next < sizeof tp_blocks / sizeof tp_blocks[0]) { /* an arrow to the next column, on each lane it spans */
            const struct tp_block *u = &tp_blocks[next];
            double ux = x0 + 40 + u->col * gx;
            int lane;
            for (lane = 0; lane < 2; lane++) {
                double ay = y0 + lane * laneh + laneh / 2;
                if (t->lane != 2 && t->lane != lane) continue;
                line(&b, x + w, ay, ux - 4, ay, "#333", 1);
                bp(&b, "<polygon points=\"%.1f,%.1f %.1f,%.1f %.1f,%.1f\" fill=\"#333\"/>\n", ux, ay, ux - 6, ay - 3,
                   ux - 6, ay + 3);
            }
        }
    }
    emit("tp.svg", (int)(x0 + 40 + 10.8 * gx), (int)(y0 + 2 * laneh + 20), &b, src);
}

/* ==== (e) memory per rank: DP against ZeRO-1/2/3 ==== */
static void memory_picture(void)
{
    static const char *const src[] = {SELF, SRC_DIR "/memory.txt", NULL};
    char *txt = must_read(SRC_DIR "/memory.txt"), *p;
    double P = 0, N = 0, meas[4] = {0, 0, 0, 0}, frac = 0, parts[4][3], top = 0, x0 = 70, y0 = 80, hgt = 220, bw = 70;
    const char *names[] = {"plain DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"}, *fills[] = {"#9ecae1", "#fd8d3c", "#a1d99b"};
    const char *legend[] = {"weights (4 B / param)",
                            "gradients (4 B)",
                            "Adam m, v (8 B)",
                            "dashed: unit-sized buffers",
                            "(ZeRO-2: a unit's gradients;",
                            "ZeRO-3: two gathered units)"};
    buf b = {0};
    int i, k, stage;
    /* examples/fsdp.c: "fsdp: layers ... (P parameters), ZeRO-S over N thread ranks" then "memory per rank: fsdp X MiB,
       plain Y MiB"; examples/zero.c: "zero: N ranks, Adam state A bytes per rank instead of U (F, 1/N = ...)" */
    for (p = strstr(txt, "fsdp: layers"); p; p = strstr(p + 1, "fsdp: layers")) {
        const char *q = strstr(p, "parameters), ZeRO-"), *m = strstr(p, "memory per rank: fsdp ");
        if (!q || !m) break;
        const char *o = q;
        while (o > p && *o != '(') o--;
        P = atof(o + 1);
        stage = atoi(q + 18);
        N = atof(strstr(q, " over ") + 6);
        if (stage >= 2 && stage <= 3) meas[stage] = atof(m + 22);
        meas[0] = atof(strstr(m, "plain ") + 6);
    }
    if ((p = strstr(txt, " ranks, Adam state ")) != NULL && strstr(p, "per rank instead of")) {
        double a = atof(p + 19), u = atof(strstr(p, "instead of ") + 11);
        frac = u > 0 ? a / u : 0;
    }
    if (P <= 0 || N <= 0 || meas[2] <= 0 || meas[3] <= 0 || frac <= 0)
        exit((fprintf(stderr, "svg: %s lacks the fsdp (stages 2 and 3) or zero lines\n", SRC_DIR "/memory.txt"), 1));
    /* bytes per parameter of each part, per rank: the formula; ZeRO-1's state fraction as examples/zero.c measured */
    for (i = 0; i < 4; i++) {
        parts[i][0] = 4 * P * (i == 3 ? 1 / N : 1);
        parts[i][1] = 4 * P * (i >= 2 ? 1 / N : 1);
        parts[i][2] = 8 * P * (i == 0 ? 1 : i == 1 ? frac : 1 / N);
    }
    meas[1] = (parts[1][0] + parts[1][1] + parts[1][2]) / 1048576.0;
    for (i = 0; i < 4; i++)
        if (meas[i] > top) top = meas[i];
    top = 4 * ceil(top / 4); /* four whole-MiB ticks */
    text(&b, 10, 22, 15, 's',
         "Memory per rank for one model: plain data parallelism against ZeRO-1, 2 and 3 (N = %.0f)", N);
    text(&b, 10, 40, 11, 's',
         "Bars: the parts by formula for P = %.0f parameters (examples/fsdp.c's MLP, AdamW, fp32). Numbers above: what "
         "the",
         P);
    text(&b, 10, 54, 11, 's',
         "examples measured (plain, ZeRO-2, ZeRO-3: dpar_fsdp_memory, with its buffers; ZeRO-1: state 1/N as "
         "examples/zero.c measured).");
    for (k = 0; k <= 4; k++) {
        double yy = y0 + hgt - hgt * k / 4;
        line(&b, x0, yy, x0 + 4 * (bw + 40), yy, "#eeeeee", 1);
        text(&b, x0 - 6, yy + 4, 10, 'e', "%.0f MiB", top * k / 4);
    }
    for (i = 0; i < 4; i++) {
        double x = x0 + 30 + i * (bw + 40), yb = y0 + hgt;
        for (k = 0; k < 3; k++) {
            double h = parts[i][k] / 1048576.0 / top * hgt;
            rect(&b, x, yb - h, bw, h, fills[k]);
            yb -= h;
        }
        if (meas[i] * 1048576.0 > parts[i][0] + parts[i][1] + parts[i][2] + 0.01 * 1048576.0) {
            double top_y = y0 + hgt - meas[i] / top * hgt; /* what the example holds beyond the formula */
            bp(&b,
               "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333\" "
               "stroke-dasharray=\"3 2\"/>\n",
               x, top_y, bw, yb - top_y);
            yb = top_y;
        }
        text(&b, x + bw / 2, yb - 6, 11, 'm', "%.1f MiB", meas[i]);
        text(&b, x + bw / 2, y0 + hgt + 16, 11, 'm', "%s", names[i]);
    }
    for (k = 0; k < 6; k++) {
        if (k < 3) rect(&b, x0 + 4 * (bw + 40) + 10, y0 + 20 + k * 18, 12, 10, fills[k]);
        text(&b, x0 + 4 * (bw + 40) + 26, y0 + 29 + k * 18, 10, 's', "%s", legend[k]);
    }
    emit("memory.svg", 820, (int)(y0 + hgt + 30), &b, src);
    free(txt);
}

/* ==== (g) lesson 14: an MoE layer's dispatch and combine, from the run the lesson page shows ==== */
#define MOE_PAGE "docs/guide/14_expert_parallel.md"
static void moe_picture(void)
{
    static const char *const src[] = {SELF, MOE_PAGE, NULL};
    char *txt = must_read(MOE_PAGE), *ln;
    int tokens = 0, experts = 0, ranks = 0, capacity = 0, t, e, k, r;
    int tok_rank[64], choice[64][2], kept[64][2], ex_rank[16], ex_choices[16], ex_kept[16];
    double prob[2], rowh = 20, gap = 14, y0 = 92, tx = 80, tw = 70, ex = 430, ew = 130, ox = 820;
    double band_top[8], band_bottom[8];
    const char *slot_color[2] = {"#08519c", "#6baed6"}, *band_fill[2] = {"#f0f5fb", "#fdf3e7"};
    buf b = {0};
    /* the first run's lines: "token T on rank R: expert E (p P) kept, expert E (p P) dropped" and
       "expert E on rank R: C choices, K kept, D dropped"; the header names the capacity */
    for (ln = strtok(txt, "\n"); ln; ln = strtok(NULL, "\n")) {
        int a[3];
        char w0[8], w1[8];
        if (!capacity && strstr(ln, " per rank; top-2 routing; capacity "))
            capacity = atoi(strstr(ln, "capacity ") + 9);
        if (tokens < 64 &&
            sscanf(ln, "token %d on rank %d: expert %d (p %lf) %7[a-z], expert %d (p %lf) %7[a-z]", &t, &r, &a[0],
                   &prob[0], w0, &a[1], &prob[1], w1) == 8 &&
            t == tokens) {
            tok_rank[tokens] = r, choice[tokens][0] = a[0], choice[tokens][1] = a[1];
            kept[tokens][0] = !strcmp(w0, "kept"), kept[tokens][1] = !strcmp(w1, "kept");
            if (r + 1 > ranks) ranks = r + 1;
            tokens++;
        }
        if (experts < 16 && sscanf(ln, "expert %d on rank %d: %d choices, %d kept", &e, &r, &a[0], &a[1]) == 4 &&
            e == experts)
            ex_rank[experts] = r, ex_choices[experts] = a[0], ex_kept[experts] = a[1], experts++;
        if (!strncmp(ln, "dispatch and combine on ", 24)) break; /* the end of the first run */
    }
    if (tokens < 2 || experts < 1 || ranks < 2 || ranks > 8 || !capacity)
        exit((fprintf(stderr, "svg: %s shows no run of 2 or more ranks (token and expert lines)\n", MOE_PAGE), 1));
    for (r = 0; r < ranks; r++) band_top[r] = 1e9, band_bottom[r] = 0;
    for (t = 0; t < tokens; t++) { /* rank r's tokens, then a gap */
        double y = y0 + t * rowh + tok_rank[t] * gap;
        if (y < band_top[tok_rank[t]]) band_top[tok_rank[t]] = y;
        if (y + rowh > band_bottom[tok_rank[t]]) band_bottom[tok_rank[t]] = y + rowh;
    }
    text(&b, 10, 22, 15, 's', "Expert parallelism: %d tokens, %d experts on %d ranks, top-2 routing, capacity %d",
         tokens, experts, ranks, capacity);
    text(&b, 10, 40, 11, 's',
         "Drawn from the run that docs/guide/14_expert_parallel.md shows. Dark: a token's first choice, light: its "
         "second; dashed, crossed: dropped");
    text(&b, 10, 54, 11, 's',
         "(the expert was full). A line that changes band crosses ranks: those rows are the all-to-all's traffic.");
    text(&b, tx + tw / 2, y0 - 16, 11, 'm', "tokens");
    text(&b, (tx + tw + ex) / 2, y0 - 16, 11, 'm', "dispatch: dpar_alltoallv");
    text(&b, ex + ew / 2, y0 - 16, 11, 'm', "experts");
    text(&b, (ex + ew + ox) / 2, y0 - 16, 11, 'm', "combine: dpar_alltoallv");
    text(&b, ox + tw / 2, y0 - 16, 11, 'm', "y = sum p_e out_e");
    for (r = 0; r < ranks; r++) {
        bp(&b, "<rect x=\"10\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"%s\"/>\n", r1(band_top[r] - 4),
           r1(ox + tw + 10), r1(band_bottom[r] - band_top[r] + 8), band_fill[r % 2]);
        text(&b, 16, (band_top[r] + band_bottom[r]) / 2 + 4, 11, 's', "rank %d", r);
    }
    for (t = 0; t < tokens; t++) {
        double y = y0 + t * rowh + tok_rank[t] * gap;
        rect(&b, tx, y + 2, tw, rowh - 4, "#ffffff");
        text(&b, tx + tw / 2, y + rowh / 2 + 4, 10, 'm', "token %d", t);
        rect(&b, ox, y + 2, tw, rowh - 4, "#ffffff");
        text(&b, ox + tw / 2, y + rowh / 2 + 4, 10, 'm', "y %d", t);
    }
    for (e = 0; e < experts; e++) { /* expert e in its rank's band, the band split among the rank's experts */
        int per_rank = experts / ranks, i = e % per_rank;
        double h = (band_bottom[ex_rank[e]] - band_top[ex_rank[e]]) / per_rank, y = band_top[ex_rank[e]] + i * h;
        rect(&b, ex, y + 4, ew, h - 8, "#fdd0a2");
        text(&b, ex + ew / 2, y + h / 2 - 3, 11, 'm', "expert %d", e);
        text(&b, ex + ew / 2, y + h / 2 + 11, 9, 'm', "%d chosen, %d kept", ex_choices[e], ex_kept[e]);
    }
    for (t = 0; t < tokens; t++)
        for (k = 0; k < 2; k++) {
            int per_rank = experts / ranks, c = choice[t][k];
            double h = (band_bottom[ex_rank[c]] - band_top[ex_rank[c]]) / per_rank;
            double ty = y0 + t * rowh + tok_rank[t] * gap + rowh / 2 + (k ? 3 : -3);
            double ey = band_top[ex_rank[c]] + (c % per_rank) * h + 10 + (h - 20) * (t + 0.5) / tokens;
            if (kept[t][k]) {
                line(&b, tx + tw, ty, ex, ey, slot_color[k], 1.2);
                line(&b, ex + ew, ey, ox, ty, slot_color[k], 1.2);
            } else {
                double mx = tx + tw + (ex - tx - tw) * 0.8, my = ty + (ey - ty) * 0.8;
                bp(&b,
                   "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#aaaaaa\" stroke-width=\"1\" "
                   "stroke-dasharray=\"3 2\"/>\n",
                   r1(tx + tw), r1(ty), r1(mx), r1(my));
                line(&b, mx - 4, my - 4, mx + 4, my + 4, "#d62728", 1.5);
                line(&b, mx - 4, my + 4, mx + 4, my - 4, "#d62728", 1.5);
            }
        }
    emit("moe.svg", (int)(ox + tw + 20), (int)(y0 + tokens * rowh + ranks * gap + 10), &b, src);
    free(txt);
}

/* ==== (h) lesson 15: ring attention's K/V ring and the zig-zag split, from the run the lesson page shows ==== */
#define CP_PAGE "docs/guide/15_context_parallel.md"
static const char *const rank_fill[] = {"#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc",
                                        "#fc9272", "#c7e9c0", "#dadaeb", "#fdd0a2"};

/* a (query chunk x key chunk) grid: row qc, column kc; blank when kc > qc (the future), the diagonal half filled */
static void chunk_grid(buf *b, double x0, double y0, double cell, int chunks, const int *owner, const char *title)
{
    int qc, kc;
    text(b, x0 + chunks * cell / 2, y0 - 8, 11, 'm', "%s", title);
    for (qc = 0; qc < chunks; qc++) {
        text(b, x0 - 4, y0 + qc * cell + cell / 2 + 4, 9, 'e', "q%d", qc);
        for (kc = 0; kc < chunks; kc++) {
            double x = x0 + kc * cell, y = y0 + qc * cell;
            if (kc > qc) rect(b, x, y, cell, cell, "#ffffff");
            else if (kc < qc) rect(b, x, y, cell, cell, rank_fill[owner[qc] % 8]);
            else {
                rect(b, x, y, cell, cell, "#ffffff");
                bp(b, "<polygon points=\"%g,%g %g,%g %g,%g\" fill=\"%s\" stroke=\"#333\" stroke-width=\".5\"/>\n",
                   r1(x), r1(y), r1(x), r1(y + cell), r1(x + cell), r1(y + cell), rank_fill[owner[qc] % 8]);
            }
        }
    }
    for (kc = 0; kc < chunks; kc++) text(b, x0 + kc * cell + cell / 2, y0 + chunks * cell + 12, 9, 'm', "k%d", kc);
}

static void context_parallel_picture(void)
{
    static const char *const src[] = {SELF, CP_PAGE, NULL};
    char *txt = must_read(CP_PAGE), *ln;
    int cp = 0, seq = 0, chunk_owner[16] = {0}, contiguous_owner[16] = {0}, held[8][2], pairs[8], found = 0, r, c;
    double cx = 170, cy = 250, radius = 115, cell = 20, height, pi = 3.14159265358979;
    buf b = {0};
    /* the first run's lines: "causal attention: S tokens, ...; cp = N ranks", "zig-zag: ...; rank r holds chunks a
       and b, ...", "ring attention: (query chunk, key chunk) pairs per rank: n n n n ..." */
    for (ln = strtok(txt, "\n"); ln && found < 3; ln = strtok(NULL, "\n")) {
        const char *at;
        if (!strncmp(ln, "causal attention: ", 18) && (at = strstr(ln, "; cp = ")) != NULL) {
            seq = atoi(ln + 18);
            cp = atoi(at + 7);
            found = cp >= 2 && cp <= 8 ? 1 : 0;
        } else if (found == 1 && !strncmp(ln, "zig-zag: ", 9)) {
            for (r = 0; r < cp; r++) {
                char key[32];
                snprintf(key, sizeof key, "rank %d holds chunks ", r);
                if (!(at = strstr(ln, key)) || sscanf(at + strlen(key), "%d and %d", &held[r][0], &held[r][1]) != 2)
                    exit((fprintf(stderr, "svg: %s: no '%s' in the zig-zag line\n", CP_PAGE, key), 1));
            }
            found = 2;
        } else if (found == 2 && !strncmp(ln, "ring attention: (query chunk, key chunk) pairs per rank:", 56)) {
            at = ln + 56;
            for (r = 0; r < cp; r++) pairs[r] = (int)strtol(at, (char **)&at, 10);
            found = 3;
        }
    }
    if (found < 3) exit((fprintf(stderr, "svg: %s shows no run with 2 to 8 ranks\n", CP_PAGE), 1));
    for (r = 0; r < cp; r++) {
        if (held[r][0] < 0 || held[r][0] >= 2 * cp || held[r][1] < 0 || held[r][1] >= 2 * cp)
            exit((fprintf(stderr, "svg: %s: rank %d holds a chunk outside 0..%d\n", CP_PAGE, r, 2 * cp - 1), 1));
        chunk_owner[held[r][0]] = r;
        chunk_owner[held[r][1]] = r;
        contiguous_owner[2 * r] = r;
        contiguous_owner[2 * r + 1] = r;
    }
    text(&b, 10, 22, 15, 's', "Ring attention on %d ranks, %d tokens cut into %d chunks, zig-zag: lesson 15's run", cp,
         seq, 2 * cp);
    text(&b, 10, 40, 11, 's',
         "Left: each rank keeps the queries of its two chunks and passes the K/V it holds to the next rank, %d hops. "
         "Right: the (query",
         cp - 1);
    text(&b, 10, 54, 11, 's',
         "chunk, key chunk) blocks of the causal mask, coloured by the rank that computes them: white ones are in the "
         "future (skipped).");
    for (r = 0; r < cp; r++) { /* the ring: rank r at angle r, an arrow to r + 1 */
        double a0 = -pi / 2 + 2 * pi * r / cp, a1 = -pi / 2 + 2 * pi * (r + 1) / cp, am = (a0 + a1) / 2;
        double x = cx + radius * cos(a0), y = cy + radius * sin(a0);
        double ax = cx + (radius + 6) * cos(am), ay = cy + (radius + 6) * sin(am);
        bp(&b, "<path d=\"M %g %g A %g %g 0 0 1 %g %g\" fill=\"none\" stroke=\"#555\" stroke-width=\"1.5\"/>\n",
           r1(cx + radius * cos(a0 + 0.35)), r1(cy + radius * sin(a0 + 0.35)), radius, radius,
           r1(cx + radius * cos(a1 - 0.35)), r1(cy + radius * sin(a1 - 0.35)));
        bp(&b, "<circle cx=\"%g\" cy=\"%g\" r=\"3\" fill=\"#555\"/>\n", r1(cx + radius * cos(a1 - 0.35)),
           r1(cy + radius * sin(a1 - 0.35)));
        text(&b, ax + 14 * cos(am), ay + 14 * sin(am) + 4, 9, 'm', "K/V");
        rect(&b, x - 52, y - 20, 104, 40, rank_fill[r % 8]);
        text(&b, x, y - 4, 11, 'm', "rank %d", r);
        text(&b, x, y + 11, 9, 'm', "chunks %d and %d", held[r][0], held[r][1]);
    }
    chunk_grid(&b, 400, 110, cell, 2 * cp, chunk_owner, "zig-zag");
    chunk_grid(&b, 400 + (2 * cp + 3) * cell, 110, cell, 2 * cp, contiguous_owner, "contiguous shards");
    for (r = 0; r < cp; r++) {
        int contiguous = 0;
        for (c = 0; c < 2; c++) contiguous += 2 * r + c + 1; /* key chunks 0..qc of its two query chunks */
        rect(&b, 400 + r * 48, 110 + 2 * cp * cell + 26, 10, 10, rank_fill[r % 8]);
        text(&b, 414 + r * 48, 110 + 2 * cp * cell + 35, 10, 's', "%d", pairs[r]);
        rect(&b, 400 + (2 * cp + 3) * cell + r * 48, 110 + 2 * cp * cell + 26, 10, 10, rank_fill[r % 8]);
        text(&b, 414 + (2 * cp + 3) * cell + r * 48, 110 + 2 * cp * cell + 35, 10, 's', "%d", contiguous);
    }
    text(&b, 400, 110 + 2 * cp * cell + 54, 10, 's', "blocks per rank (the run's count): equal");
    text(&b, 400 + (2 * cp + 3) * cell, 110 + 2 * cp * cell + 54, 10, 's', "blocks per rank: the last rank waited for");
    height = 110 + 2 * cp * cell + 70;
    if (height < cy + radius + 40) height = cy + radius + 40;
    emit("context_parallel.svg", (int)(400 + (4 * cp + 3) * cell + 90), (int)height, &b, src);
    free(txt);
}

/* ==== (f) the benchmarks: docs/img/src/bench.txt, one plot per family of bench= lines ==== */
#define MAXLINES 1024
static char *bench_line[MAXLINES];
static int bench_lines;

static void bench_load(void)
{
    char *txt = must_read(SRC_DIR "/bench.txt"), *ln;
    for (ln = strtok(txt, "\n"); ln && bench_lines < MAXLINES; ln = strtok(NULL, "\n"))
        if (!strncmp(ln, "bench=", 6)) bench_line[bench_lines++] = ln; /* txt stays allocated: the lines point in */
}

/* the value of key (" key=" or "bench=") in line i; NAN when absent; val_is: the text equals want */
static double val(int i, const char *key)
{
    char k[48];
    const char *p;
    snprintf(k, sizeof k, " %s=", key);
    p = strstr(bench_line[i], k);
    return p ? atof(p + strlen(k)) : NAN;
}
static int val_is(int i, const char *key, const char *want)
{
    char k[64];
    const char *p;
    size_t n = strlen(want);
    if (!strcmp(key, "bench")) return !strncmp(bench_line[i] + 6, want, n) && bench_line[i][6 + n] == ' ';
    snprintf(k, sizeof k, " %s=", key);
    p = strstr(bench_line[i], k);
    return p && !strncmp(p + strlen(k), want, n) && (p[strlen(k) + n] == ' ' || !p[strlen(k) + n]);
}

#define MAXPTS 64
typedef struct series {
    char label[48];
    const char *color;
    int n, dashed;
    double x[MAXPTS], y[MAXPTS];
} series;

static const char *const palette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"};

static void add_point(series *s, double x, double y)
{
    if (s->n < MAXPTS && !isnan(x) && !isnan(y)) s->x[s->n] = x, s->y[s->n] = y, s->n++;
}

static double nice_top(double v) /* 1, 2 or 5 times a power of ten, at least v */
{
    double e = pow(10, floor(log10(v > 0 ? v : 1))), m[] = {1, 2, 5, 10};
    int i;
    for (i = 0; i < 4; i++)
        if (m[i] * e >= v) return m[i] * e;
    return 10 * e;
}

static void size_label(char *out, size_t n, double bytes)
{
    if (bytes >= 1048576) snprintf(out, n, "%.0f MiB", bytes / 1048576);
    else if (bytes >= 1024) snprintf(out, n, "%.0f KiB", bytes / 1024);
    else snprintf(out, n, "%.0f B", bytes);
}

/* a line plot. logx: 0 linear, 1 log2 labelled as sizes in bytes, 2 log2 labelled as numbers; logy: decades, else
   linear from 0; an optional dashed line at y = ref */
static double ymin_, ymax_; /* the y axis of the plot being drawn; ymin_ > 0: logarithmic */
static double ypos(double y, double y0, double h)
{
    if (ymin_ > 0) return y0 + h - (log10(y > ymin_ ? y : ymin_) - log10(ymin_)) / (log10(ymax_) - log10(ymin_)) * h;
    return y0 + h - y / ymax_ * h;
}

static void lines_plot(const char *name, const char *title, const char *sub1, const char *sub2, const char *ylabel,
                       int logx, int logy, series *s, int ns, double ref, const char *const *src)
{
    buf b = {0};
    double x0 = 70, y0 = 76, w = 560, h = 260, xmin = 1e300, xmax = -1e300, ymin = 1e300, ymax = 0, xx;
    int i, k, ticks;
    for (k = 0; k < ns; k++)
        for (i = 0; i < s[k].n; i++) {
            double x = logx ? log2(s[k].x[i]) : s[k].x[i];
            if (x < xmin) xmin = x;
            if (x > xmax) xmax = x;
            if (s[k].y[i] > ymax) ymax = s[k].y[i];
            if (s[k].y[i] > 0 && s[k].y[i] < ymin) ymin = s[k].y[i];
        }
    if (xmax <= xmin) xmax = xmin + 1;
    if (ref > ymax) ymax = ref;
    if (logy) {
        ymin_ = pow(10, floor(log10(ymin < ymax ? ymin : ymax / 10)));
        ymax_ = pow(10, ceil(log10(ymax)));
    } else {
        ymin_ = 0;
        ymax_ = nice_top(ymax);
    }
    ymax = ymax_;
    text(&b, 10, 22, 15, 's', "%s", title);
    text(&b, 10, 40, 11, 's', "%s", sub1);
    text(&b, 10, 54, 11, 's', "%s", sub2);
    ticks = logy ? (int)lround(log10(ymax_ / ymin_)) : 4;
    for (k = 0; k <= ticks; k++) {
        double v = logy ? ymin_ * pow(10, k) : ymax_ * k / 4, yy = ypos(v, y0, h);
        line(&b, x0, yy, x0 + w, yy, "#eeeeee", 1);
        text(&b, x0 - 6, yy + 4, 10, 'e', "%g", v);
    }
    bp(&b,
       "<text x=\"14\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\" transform=\"rotate(-90 14 "
       "%.1f)\">%s</text>\n",
       y0 + h / 2, y0 + h / 2, ylabel);
    ticks = logx ? (int)(xmax - xmin) : 4;
    for (k = 0; k <= ticks; k++) {
        char lab[32];
        double v = xmin + (xmax - xmin) * k / (ticks ? ticks : 1);
        if (logx && ((int)v % 2) != 0 && ticks > 12) continue;
        xx = x0 + (v - xmin) / (xmax - xmin) * w;
        line(&b, xx, y0 + h, xx, y0 + h + 4, "#333", 1);
        if (logx == 1) size_label(lab, sizeof lab, pow(2, v));
        else if (logx) snprintf(lab, sizeof lab, "%.0f", pow(2, v));
        else snprintf(lab, sizeof lab, "%g", v);
        text(&b, xx, y0 + h + 16, 9, 'm', "%s", lab);
    }
    line(&b, x0, y0 + h, x0 + w, y0 + h, "#333", 1);
    if (ref > 0)
        bp(&b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\" stroke-dasharray=\"4 3\"/>\n", x0,
           ypos(ref, y0, h), x0 + w, ypos(ref, y0, h));
    for (k = 0; k < ns; k++) {
        bp(&b, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\"%s points=\"", s[k].color,
           s[k].dashed ? " stroke-dasharray=\"5 3\"" : "");
        for (i = 0; i < s[k].n; i++)
            bp(&b, "%s%.1f,%.1f", i ? " " : "", x0 + ((logx ? log2(s[k].x[i]) : s[k].x[i]) - xmin) / (xmax - xmin) * w,
               ypos(s[k].y[i], y0, h));
        bp(&b, "\"/>\n");
        bp(&b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s/>\n",
           x0 + w + 14, y0 + 10 + k * 16, x0 + w + 34, y0 + 10 + k * 16, s[k].color,
           s[k].dashed ? " stroke-dasharray=\"5 3\"" : "");
        text(&b, x0 + w + 38, y0 + 14 + k * 16, 10, 's', "%s", s[k].label);
    }
    emit(name, (int)(x0 + w + 190), (int)(y0 + h + 28), &b, src);
}

/* grouped bars: groups g (labels), series k (names), v[g * ns + k]; an optional dashed line at y = ref */
static void bars_plot(const char *name, const char *title, const char *sub1, const char *sub2, const char *ylabel,
                      char (*groups)[40], int ng, const char *const *names, int ns, const double *v, double ref,
                      const char *const *src)
{
    buf b = {0};
    double x0 = 70, y0 = 76, h = 240, gw = ns * 16 + 14, w = ng * gw, ymax = ref;
    int g, k;
    for (g = 0; g < ng * ns; g++)
        if (v[g] > ymax) ymax = v[g];
    ymax = nice_top(ymax);
    text(&b, 10, 22, 15, 's', "%s", title);
    text(&b, 10, 40, 11, 's', "%s", sub1);
    text(&b, 10, 54, 11, 's', "%s", sub2);
    for (k = 0; k <= 4; k++) {
        double yy = y0 + h - h * k / 4;
        line(&b, x0, yy, x0 + w, yy, "#eeeeee", 1);
        text(&b, x0 - 6, yy + 4, 10, 'e', "%g", ymax * k / 4);
    }
    bp(&b,
       "<text x=\"14\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\" transform=\"rotate(-90 14 "
       "%.1f)\">%s</text>\n",
       y0 + h / 2, y0 + h / 2, ylabel);
    for (g = 0; g < ng; g++) {
        double gx = x0 + g * gw + 7;
        for (k = 0; k < ns; k++) {
            double bh = isnan(v[g * ns + k]) ? 0 : v[g * ns + k] / ymax * h;
            rect(&b, gx + k * 16, y0 + h - bh, 14, bh, palette[k]);
        }
        bp(&b,
           "<text x=\"%.1f\" y=\"%.1f\" font-size=\"9\" text-anchor=\"end\" transform=\"rotate(-40 %.1f "
           "%.1f)\">%s</text>\n",
           gx + ns * 8, y0 + h + 12, gx + ns * 8, y0 + h + 12, groups[g]);
    }
    line(&b, x0, y0 + h, x0 + w, y0 + h, "#333", 1);
    if (ref > 0)
        bp(&b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\" stroke-dasharray=\"4 3\"/>\n", x0,
           y0 + h - ref / ymax * h, x0 + w, y0 + h - ref / ymax * h);
    for (k = 0; k < ns; k++) {
        rect(&b, x0 + w + 14, y0 + 4 + k * 16, 12, 10, palette[k]);
        text(&b, x0 + w + 30, y0 + 13 + k * 16, 10, 's', "%s", names[k]);
    }
    emit(name, x0 + w + 230 > 820 ? (int)(x0 + w + 230) : 820, (int)(y0 + h + 70), &b, src);
}

static void bench_pictures(void)
{
    static const char *const src[] = {SELF, SRC_DIR "/bench.txt", NULL};
    static const char *const algos[][3] = {{"auto", "auto", "auto (dpar's choice)"},
                                           {"ring", "forced", "ring"},
                                           {"oneshot", "forced", "one-shot"},
                                           {"slice", "forced", "reduce-by-slice"},
                                           {"tree", "auto", "deterministic tree"}};
    char groups[64][40];
    double v[64 * 4];
    series s[8];
    int i, k, a, ng, ranks;
    bench_load();
    /* allreduce over thread ranks: ratio = ref_us / us against size, per algorithm; one plot per rank count */
    for (ranks = 2; ranks <= 8; ranks *= 2) {
        char file[64], title[128];
        memset(s, 0, sizeof s);
        for (a = 0; a < 5; a++) {
            snprintf(s[a].label, sizeof s[a].label, "%s", algos[a][2]);
            s[a].color = palette[a];
            s[a].dashed = a > 0;
            for (i = 0; i < bench_lines; i++)
                if (val_is(i, "bench", "allreduce") && val(i, "ranks") == ranks &&
                    val_is(i, "transport", a == 4 ? "threads-det" : "threads") && val_is(i, "mode", algos[a][1]) &&
                    (a == 0 || val_is(i, "algo", algos[a][0])))
                    add_point(&s[a], val(i, "bytes"), val(i, "ratio"));
        }
        if (!s[0].n) continue;
        snprintf(file, sizeof file, "bench_allreduce_%d.svg", ranks);
        snprintf(title, sizeof title, "bench=allreduce: %d thread ranks, f32 sum, against one pass over memory", ranks);
        lines_plot(
            file, title,
            "ratio = ref_us / us: ref is the N threads each adding two arrays of that many bytes "
            "(out = x + y)",
            "at once; 1 means the allreduce costs one pass over memory. Dashed: each algorithm forced. (bench_comm)",
            "ratio (higher is faster)", 1, 1, s, 5, 1.0, src);
    }
    /* MPI: ratio = mpi_us / dpar_us against size */
    memset(s, 0, sizeof s);
    snprintf(s[0].label, sizeof s[0].label, "ratio (dpar's choice)");
    snprintf(s[1].label, sizeof s[1].label, "msg_ratio (no shared block)");
    snprintf(s[2].label, sizeof s[2].label, "ring_ratio (ring forced)");
    for (k = 0; k < 3; k++) s[k].color = palette[k], s[k].dashed = k > 0;
    for (i = 0; i < bench_lines; i++)
        if (val_is(i, "bench", "allreduce") && val_is(i, "transport", "mpi")) {
            add_point(&s[0], val(i, "bytes"), val(i, "ratio"));
            add_point(&s[1], val(i, "bytes"), val(i, "msg_ratio"));
            add_point(&s[2], val(i, "bytes"), val(i, "ring_ratio"));
        }
    if (s[0].n)
        lines_plot("bench_mpi.svg", "bench=allreduce transport=mpi: dpar over MPI against MPI_Allreduce, 2 processes",
                   "ratio = mpi_us / dpar_us in the same run: above 1, dpar's allreduce is faster than the MPI "
                   "library's own.",
                   "msg_ratio: dpar without the node's shared block (as between nodes); ring_ratio: the ring forced. "
                   "(bench_mpi)",
                   "ratio (higher: dpar faster)", 1, 0, s, 3, 1.0, src);
    /* GEMM: GFLOP/s against n, dpar and OpenBLAS, per mode */
    memset(s, 0, sizeof s);
    for (k = 0; k < 4; k++) {
        const char *mode = k < 2 ? "sharded" : "builtin";
        snprintf(s[k].label, sizeof s[k].label, "%s %s", mode, k % 2 ? "OpenBLAS" : "dpar");
        s[k].color = palette[k / 2];
        s[k].dashed = k % 2;
        for (i = 0; i < bench_lines; i++)
            if (val_is(i, "bench", "gemm") && val_is(i, "mode", mode))
                add_point(&s[k], val(i, "n"), val(i, k % 2 ? "openblas_gflops" : "dpar_gflops"));
    }
    if (s[0].n || s[2].n)
        lines_plot("bench_gemm.svg", "bench=gemm: GFLOP/s of an n x n x n sgemm, dpar against OpenBLAS",
                   "sharded: dpar's pool of 2 threads cutting one GEMM into single-threaded OpenBLAS calls, against "
                   "OpenBLAS's 2 threads;",
                   "builtin: dpar's own kernel against single-threaded OpenBLAS. ratio = dpar / OpenBLAS. (bench_gemm)",
                   "GFLOP/s", 2, 0, s, 4, 0, src);
    /* pipeline bubbles: predicted against measured, per case; the sleeping and the computing callbacks */
    for (a = 0; a < 2; a++) {
        static const char *const nm[] = {"predicted_bubble", "measured_bubble"};
        ng = 0;
        for (i = 0; i < bench_lines && ng < 64; i++)
            if (val_is(i, "bench", a ? "pipeline_gemm" : "pipeline")) {
                const char *sc = strstr(bench_line[i], "sched=") + 6;
                snprintf(groups[ng], sizeof groups[ng], "%.*s p=%g m=%g", (int)strcspn(sc, " "), sc, val(i, "p"),
                         val(i, "m"));
                v[ng * 2] = val(i, "predicted_bubble"), v[ng * 2 + 1] = val(i, "measured_bubble");
                ng++;
            }
        if (ng)
            bars_plot(
                a ? "bench_pipeline_gemm.svg" : "bench_pipeline.svg",
                a ? "bench=pipeline_gemm: bubbles with stages that compute (GEMMs), predicted and measured"
                  : "bench=pipeline: bubbles with balanced sleeping stages, predicted and measured",
                "predicted: dpar_pipe_schedule's bubble (backward = 2 x forward); measured: 1 - time in callbacks "
                "/ (p x the longest stage's run).",
                a ? "A forward is sgemm calls of 256^3 on the stage's own matrices: the stages share 2 cores. "
                    "(bench_pipe)"
                  : "A forward sleeps 2 ms / v, a backward twice that: 4 stages share 2 cores without competing. "
                    "(bench_pipe)",
                "bubble (idle fraction)", groups, ng, nm, 2, v, 0, src);
    }
    /* per-call overheads and ports: time of dpar against OpenMP's */
    {
        static const char *const nm[] = {"dpar", "OpenMP"};
        ng = 0;
        for (i = 0; i < bench_lines && ng < 64; i++)
            if (val_is(i, "bench", "pool_for") || val_is(i, "bench", "pool_barrier")) {
                snprintf(groups[ng], sizeof groups[ng], "%.*s, %g threads", (int)strcspn(bench_line[i] + 6, " "),
                         bench_line[i] + 6, val(i, "threads"));
                v[ng * 2] = val(i, "dpar_us"), v[ng * 2 + 1] = val(i, "omp_us");
                ng++;
            }
        if (ng)
            bars_plot("bench_pool.svg", "bench=pool_for, pool_barrier: per-call overhead, dpar's pool and OpenMP",
                      "EPCC syncbench method: many calls of a tiny work item, minus its serial time; medians of "
                      "interleaved samples.",
                      "ratio = dpar_us / omp_us: below 1, dpar's call costs less. (bench_pool)",
                      "microseconds per call", groups, ng, nm, 2, v, 0, src);
    }
    /* training: samples per second on 1 and 2 ranks and the ceiling */
    {
        static const char *const nm[] = {"samples/s"};
        ng = 0;
        for (i = 0; i < bench_lines && ng < 8; i++)
            if (val_is(i, "bench", "train") || val_is(i, "bench", "train_ceiling")) {
                if (val_is(i, "bench", "train_ceiling")) snprintf(groups[ng], sizeof groups[ng], "ceiling: 2 x 1 rank");
                else
                    snprintf(groups[ng], sizeof groups[ng], "%d rank%s", (int)val(i, "threads"),
                             val(i, "threads") > 1 ? "s" : "");
                v[ng] = val(i, "samples_per_s");
                ng++;
            }
        if (ng)
            bars_plot(
                "bench_train.svg", "bench=train: examples/data_parallel.c, 784-1024-1024-10, global batch 256",
                "Samples per second on 1 and 2 thread ranks (medians of 7 alternating runs), and the ceiling: two "
                "independent",
                "1-rank processes at batch 128 each, run at once (the same work with no communication). "
                "(bench/bench_train.sh)",
                "samples per second", groups, ng, nm, 1, v, 0, src);
    }
    /* ZeRO-2/3 against plain data parallelism: time per step */
    {
        static const char *const nm[] = {"dpar_fsdp", "plain data parallelism"};
        ng = 0;
        for (i = 0; i < bench_lines && ng < 8; i++)
            if (val_is(i, "bench", "fsdp")) {
                snprintf(groups[ng], sizeof groups[ng], "ZeRO-%g, %g ranks", val(i, "stage"), val(i, "ranks"));
                v[ng * 2] = val(i, "step_ms"), v[ng * 2 + 1] = val(i, "dp_step_ms");
                ng++;
            }
        if (ng)
            bars_plot(
                "bench_fsdp.svg", "bench=fsdp: a step of examples/fsdp.c, ZeRO-2 and ZeRO-3 against plain DP",
                "Milliseconds per training step, both trained in the same run on the same data.",
                "ratio = dp_step_ms / step_ms: above 1, the sharded step is the faster. (examples/fsdp.c --bench)",
                "ms per step", groups, ng, nm, 2, v, 0, src);
    }
}

/* ==== (i) lesson 17: the dynamic loss scale and both runs' losses, from the run the lesson page shows ==== */
#define MP_PAGE "docs/guide/17_mixed_precision.md"
#define MP_STEPS 64

static void mixed_precision_picture(void)
{
    static const char *const src[] = {SELF, MP_PAGE, NULL};
    char *txt = must_read(MP_PAGE), *ln;
    double scale[MP_STEPS], loss16[MP_STEPS], loss32[MP_STEPS], top_loss = 0, low_log = 99, high_log = 0;
    int skipped[MP_STEPS], steps = 0, s;
    double x0 = 70, y0 = 80, w = 640, h1 = 130, gap = 50, h2 = 130, dx;
    buf b = {0};
    /* the run's lines: "step N  scale S  loss L  (fp32 R)" or "step N  scale S  SKIPPED: ..." */
    for (ln = strtok(txt, "\n"); ln; ln = strtok(NULL, "\n")) {
        int step;
        double sc, l16, l32;
        if (sscanf(ln, "step %d scale %lf", &step, &sc) != 2 || step != steps || steps >= MP_STEPS) continue;
        scale[steps] = sc;
        skipped[steps] = strstr(ln, "SKIPPED") != NULL;
        loss16[steps] = loss32[steps] = -1;
        if (!skipped[steps] && sscanf(ln, "step %d scale %lf loss %lf (fp32 %lf)", &step, &sc, &l16, &l32) == 4) {
            loss16[steps] = l16;
            loss32[steps] = l32;
            if (l16 > top_loss) top_loss = l16;
            if (l32 > top_loss) top_loss = l32;
        }
        if (log2(sc) < low_log) low_log = log2(sc);
        if (log2(sc) > high_log) high_log = log2(sc);
        steps++;
    }
    if (steps < 2 || top_loss <= 0) exit((fprintf(stderr, "svg: %s shows no run of lesson 17\n", MP_PAGE), 1));
    low_log -= 1;
    high_log += 1;
    top_loss = nice_top(top_loss);
    dx = w / steps;
    text(&b, 10, 22, 15, 's', "Dynamic loss scaling, f16 compute on 2 ranks: lesson 17's run of %d steps", steps);
    text(&b, 10, 40, 11, 's',
         "Top: the loss scale each step used (log scale); a red step was skipped by every rank (an inf in some rank's "
         "f16 gradients),");
    text(&b, 10, 54, 11, 's',
         "the scale halved; six good steps double it. Bottom: the loss before each step, f16 compute with fp32 master "
         "weights (blue)");
    text(&b, 10, 68, 11, 's',
         "against the fp32 run (orange dashed, under the blue: they agree to 3 or 4 digits); skipped steps have no "
         "loss.");
    rect(&b, x0, y0, w, h1, "#ffffff");
    for (s = (int)low_log + 1; s < (int)high_log; s++) {
        double y = y0 + h1 - (s - low_log) / (high_log - low_log) * h1;
        line(&b, x0, y, x0 + w, y, "#eeeeee", 1);
        text(&b, x0 - 4, y + 4, 9, 'e', "%.0f", pow(2, s));
    }
    for (s = 0; s < steps; s++) {
        double y = y0 + h1 - (log2(scale[s]) - low_log) / (high_log - low_log) * h1;
        rect(&b, x0 + s * dx + 1, y, dx - 2, y0 + h1 - y, skipped[s] ? "#fc9272" : "#9ecae1");
        if (skipped[s]) text(&b, x0 + s * dx + dx / 2, y - 4, 9, 'm', "skip");
        if (s % 5 == 0) text(&b, x0 + s * dx + dx / 2, y0 + h1 + 12, 9, 'm', "%d", s);
    }
    text(&b, x0 + w / 2, y0 + h1 + 26, 10, 'm', "step");
    rect(&b, x0, y0 + h1 + gap, w, h2, "#ffffff");
    for (s = 0; s <= 4; s++) {
        double y = y0 + h1 + gap + h2 - s / 4.0 * h2;
        line(&b, x0, y, x0 + w, y, "#eeeeee", 1);
        text(&b, x0 - 4, y + 4, 9, 'e', "%.3g", top_loss * s / 4);
    }
    for (s = 1; s < steps; s++) { /* a segment where both ends have a loss below the top */
        double xa = x0 + (s - 0.5) * dx, xb = x0 + (s + 0.5) * dx, base = y0 + h1 + gap + h2;
        if (loss16[s - 1] < 0 || loss16[s] < 0 || loss16[s - 1] > top_loss || loss32[s - 1] > top_loss) continue;
        line(&b, xa, base - loss16[s - 1] / top_loss * h2, xb, base - loss16[s] / top_loss * h2, "#2171b5", 2);
        bp(&b,
           "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#e6550d\" stroke-width=\"1.5\" "
           "stroke-dasharray=\"4 3\"/>\n",
           r1(xa), r1(base - loss32[s - 1] / top_loss * h2), r1(xb), r1(base - loss32[s] / top_loss * h2));
    }
    for (s = 0; s < steps; s++)
        if (s % 5 == 0) text(&b, x0 + s * dx + dx / 2, y0 + h1 + gap + h2 + 12, 9, 'm', "%d", s);
    text(&b, x0 + w / 2, y0 + h1 + gap + h2 + 26, 10, 'm', "step");
    emit("mixed_precision.svg", (int)(x0 + w + 30), (int)(y0 + h1 + gap + h2 + 40), &b, src);
    free(txt);
}

/* ==== (j) lesson 18: clipping by the global norm against shard by shard, from the run the lesson page shows ==== */
#define CLIP_PAGE "docs/guide/18_accumulation_clipping.md"

static void clipping_picture(void)
{
    static const char *const src[] = {SELF, CLIP_PAGE, NULL};
    char *txt = must_read(CLIP_PAGE), *at;
    double squares[4], norms[4], coefficients[4], global_norm, global_coefficient, x0 = 150, bar = 300, rowh = 44;
    int r;
    size_t offset, length;
    buf b = {0};
    /* "step 0: shards' squares a b c d; global norm G" and "...each shard's own norm n n n n, so coefficients c c c c
       instead of C for all" */
    at = strstr(txt, "\nstep 0: shards' squares ");
    if (!at || sscanf(at, "\nstep 0: shards' squares %lf %lf %lf %lf; global norm %lf", &squares[0], &squares[1],
                      &squares[2], &squares[3], &global_norm) != 5)
        exit((fprintf(stderr, "svg: %s shows no step 0 of 4 ranks\n", CLIP_PAGE), 1));
    at = strstr(txt, "each shard's own norm ");
    if (!at || sscanf(at, "each shard's own norm %lf %lf %lf %lf, so coefficients %lf %lf %lf %lf instead of %lf",
                      &norms[0], &norms[1], &norms[2], &norms[3], &coefficients[0], &coefficients[1], &coefficients[2],
                      &coefficients[3], &global_coefficient) != 9)
        exit((fprintf(stderr, "svg: %s shows no shard-by-shard line\n", CLIP_PAGE), 1));
    text(&b, 10, 22, 15, 's', "Clipping sharded gradients to norm 1: lesson 18's step 0, 4 ranks, 10 parameters");
    text(&b, 10, 40, 11, 's',
         "Each rank holds a shard of the gradient and the sum of its squares; one allreduce adds them:");
    text(&b, 10, 54, 11, 's',
         "norm = sqrt(%.3g + %.3g + %.3g + %.3g) = %.3f, so every shard is multiplied by %.3f (blue).", squares[0],
         squares[1], squares[2], squares[3], global_norm, global_coefficient);
    text(&b, 10, 68, 11, 's',
         "Clipped by its own norm instead, each shard gets another factor (red): the update turns and grows.");
    for (r = 0; r < 4; r++) {
        double y = 90 + r * rowh;
        dpar_block_range(10, 4, r, &offset, &length);
        rect(&b, 10, y, 130, rowh - 8, rank_fill[r]);
        text(&b, 16, y + 15, 11, 's', "rank %d: w[%zu..%zu]", r, offset, offset + length - 1);
        text(&b, 16, y + 29, 9, 's', "squares %.3g, norm %.3f", squares[r], norms[r]);
        rect(&b, x0, y + 2, bar * global_coefficient, 14, "#6baed6");
        text(&b, x0 + bar * global_coefficient + 4, y + 13, 9, 's', "%.3f global", global_coefficient);
        rect(&b, x0, y + 19, bar * coefficients[r], 14, "#fc9272");
        text(&b, x0 + bar * coefficients[r] + 4, y + 30, 9, 's', "%.3f own norm", coefficients[r]);
    }
    line(&b, x0, 86, x0, 90 + 4 * rowh - 4, "#333", 1);
    line(&b, x0 + bar, 86, x0 + bar, 90 + 4 * rowh - 4, "#bbbbbb", 1);
    text(&b, x0 + bar, 90 + 4 * rowh + 8, 9, 'm', "1 (not clipped)");
    text(&b, x0, 90 + 4 * rowh + 8, 9, 'm', "0");
    emit("clipping.svg", 680, (int)(90 + 4 * rowh + 20), &b, src);
    free(txt);
}

/* ==== (k) lesson 19: what reshards and what must not change, from the run the lesson page shows ==== */
#define EL_PAGE "docs/guide/19_checkpoint_elastic.md"

static void elastic_picture(void)
{
    static const char *const src[] = {SELF, EL_PAGE, NULL};
    char *txt = must_read(EL_PAGE), *at;
    int blocks_before[2][8], blocks_after[2][8], count[2] = {0, 0}, after_ranks = 0, step = 0, epoch = 0, used = 0;
    int samples = 0, unit, r;
    double x0 = 150, scale = 14, y;
    buf b = {0};
    /* "unit U (N, C values): blocks of 4 ranks a b c d -> of R ranks e f" and "its position: step S, epoch E, C of the
       epoch's N samples consumed" */
    for (unit = 0; unit < 2; unit++) {
        char key[32], *p;
        snprintf(key, sizeof key, "\nunit %d (", unit);
        at = strstr(txt, key);
        if (!at || !(at = strstr(at, "values): blocks of 4 ranks ")))
            exit((fprintf(stderr, "svg: %s shows no blocks of unit %d\n", EL_PAGE, unit), 1));
        p = at + strlen("values): blocks of 4 ranks ");
        for (r = 0; r < 4; r++) blocks_before[unit][r] = (int)strtol(p, &p, 10);
        if (sscanf(p, " -> of %d ranks", &after_ranks) != 1 || after_ranks < 1 || after_ranks > 8)
            exit((fprintf(stderr, "svg: %s: no '-> of R ranks' for unit %d\n", EL_PAGE, unit), 1));
        p = strstr(p, "ranks") + 5;
        for (r = 0; r < after_ranks; r++) blocks_after[unit][r] = (int)strtol(p, &p, 10);
        for (r = 0; r < 4; r++) count[unit] += blocks_before[unit][r];
    }
    at = strstr(txt, "\nits position: step ");
    if (!at ||
        sscanf(at, "\nits position: step %d, epoch %d, %d of the epoch's %d samples", &step, &epoch, &used, &samples) !=
            4 ||
        samples < 1)
        exit((fprintf(stderr, "svg: %s shows no position line\n", EL_PAGE), 1));
    text(&b, 10, 22, 15, 's', "An elastic restart: lesson 19's checkpoint of 4 ranks loaded by %d", after_ranks);
    text(&b, 10, 40, 11, 's',
         "What reshards: each rank's block of every unit and of its Adam moments (m, v: the same blocks), by "
         "dpar_block_range.");
    text(&b, 10, 54, 11, 's',
         "What must not change: the global batch, the shuffle of each epoch and the position in it (stored in the "
         "checkpoint).");
    y = 74;
    for (unit = 0; unit < 2; unit++) {
        double x = x0;
        text(&b, 10, y + 15, 11, 's', "unit %d (%s, %d values)", unit, unit == 0 ? "W" : "b", count[unit]);
        for (r = 0; r < 4; r++) {
            rect(&b, x, y, blocks_before[unit][r] * scale, 20, rank_fill[r]);
            text(&b, x + blocks_before[unit][r] * scale / 2, y + 14, 9, 'm', "r%d: %d", r, blocks_before[unit][r]);
            x += blocks_before[unit][r] * scale;
        }
        text(&b, x + 8, y + 14, 10, 's', "4 ranks (saved)");
        x = x0;
        for (r = 0; r < after_ranks; r++) {
            rect(&b, x, y + 26, blocks_after[unit][r] * scale, 20, rank_fill[r]);
            text(&b, x + blocks_after[unit][r] * scale / 2, y + 40, 9, 'm', "r%d: %d", r, blocks_after[unit][r]);
            x += blocks_after[unit][r] * scale;
        }
        text(&b, x + 8, y + 40, 10, 's', "%d ranks (loaded)", after_ranks);
        y += 64;
    }
    text(&b, 10, y + 15, 11, 's', "epoch %d's shuffle", epoch);
    rect(&b, x0, y, samples * 4, 20, "#ffffff");
    rect(&b, x0, y, used * 4, 20, "#bdbdbd");
    text(&b, x0 + used * 2, y + 14, 9, 'm', "%d consumed before step %d", used, step);
    text(&b, x0 + used * 4 + (samples - used) * 2, y + 14, 9, 'm', "next");
    text(&b, x0 + samples * 4 + 8, y + 14, 10, 's', "the position the checkpoint stores");
    emit("elastic.svg", 760, (int)(y + 34), &b, src);
    free(txt);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--check")) check_mode = 1;
    else if (argc > 1) return fprintf(stderr, "usage: svg [--check]   (from the repository's root)\n"), 2;
    ring_picture();
    pipeline_picture();
    zero_bubble_picture();
    v_schedules_picture();
    dp_picture();
    tp_picture();
    memory_picture();
    moe_picture();
    context_parallel_picture();
    mixed_precision_picture();
    clipping_picture();
    elastic_picture();
    bench_pictures();
    if (check_mode) { /* an SVG that nothing makes any more */
        DIR *d = opendir(OUT_DIR);
        struct dirent *e;
        int k;
        while (d && (e = readdir(d)) != NULL) {
            size_t n = strlen(e->d_name);
            if (n < 4 || strcmp(e->d_name + n - 4, ".svg") != 0) continue;
            for (k = 0; k < nmade && strcmp(made[k], e->d_name) != 0; k++) {}
            if (k == nmade) {
                printf("LEFTOVER %s/%s: make docs no longer makes it; delete it\n", OUT_DIR, e->d_name);
                problems++;
            }
        }
        if (d) closedir(d);
    }
    if (check_mode)
        printf("%s\n", problems ? "make docs: some pictures are out of date" : "every picture is up to date");
    return problems ? 1 : 0;
}
