/* char_lm.c - dpar's demo: a character-level language model trained data-parallel over thread ranks.
   Build: cc -std=c99 -O2 -I. demo/char_lm.c -o char_lm -pthread -lm
   Run:   ./char_lm                       (or: make demo; ./char_lm --help for the options)

   The model (Bengio et al. 2003, at toy scale): the last CTX characters are looked up in an
   embedding table, concatenated, passed through one tanh hidden layer, and a softmax over the
   alphabet predicts the next character. It trains on the text's first 90% and reports its loss on
   the last 10% (held out), beside a table of bigram counts: the sample is as good as the held-out loss.
   Training is data-parallel: every rank (a thread) holds a replica of the parameters, takes its own share of each
   batch, and the ranks average their gradients with dpar's ring allreduce before each Adam step, so the replicas
   stay identical.
   Each step's batch is drawn from (seed, step) alone, sample by sample, whatever the rank count: a run resumed
   from a checkpoint makes the same steps as one that never stopped (bit for bit with the same --threads; with
   another --threads, within float rounding: each rank's gradient sums its share of the batch). */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <ctype.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CTX 6   /* characters of context: 16 let the model learn the text by heart (see eval_heldout) */
#define EMB 16  /* embedding width */
#define HID 256 /* hidden units */
#define MAXR 64 /* most ranks */

typedef struct {
    const char *data, *ckpt, *trace;
    int steps, stop_at, threads, batch, resume, overwrite, sample, seed;
    float lr, temp;
} options;

typedef struct { /* what every rank shares */
    options o;
    unsigned char *text; /* the text as alphabet indices */
    size_t n, n_train;   /* characters; training uses text[0, n_train), the rest is held out */
    int V;               /* alphabet size */
    unsigned char alphabet[256];
    uint64_t text_id[2];    /* the text's bytes and CRC-32: a checkpoint resumes on the text it was trained on only */
    int binary;             /* the text does not look like text: the sample shows its odd bytes as \xNN */
    size_t np;              /* parameters */
    float *params[MAXR];    /* each rank's replica */
    float *adam_m, *adam_v; /* rank 0's optimizer state; every rank keeps its own copy below */
    int64_t step0, step;    /* first step of this run, steps done */
    float first_loss, last_loss; /* rank 0's view: the first step's loss, a running mean of the last ~50 */
    dpar_group *group;
    double t_start;
    int tty; /* stdout is a terminal: one refreshing progress line */
} trainer;

static volatile sig_atomic_t interrupted;
static void on_sigint(int sig)
{
    (void)sig;
    interrupted = 1;
}

/* parameters in one flat array: [embedding V x EMB | W1 CTX*EMB x HID | b1 HID | W2 HID x V | b2 V] */
#define OFF_W1(V) ((size_t)EMB * (V))
#define OFF_B1(V) (OFF_W1(V) + (size_t)CTX * EMB * HID)
#define OFF_W2(V) (OFF_B1(V) + HID)
#define OFF_B2(V) (OFF_W2(V) + (size_t)HID * (V))
#define NPARAMS(V) (OFF_B2(V) + (size_t)(V))

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float uniform(uint64_t *s) { return (float)(splitmix(s) >> 40) / 16777216.0f; }

/* forward for b contexts starting at pos[]: X (b x CTX*EMB), H (b x HID), Z (b x V) logits */
static void forward(const trainer *t, const float *p, const size_t *pos, int b, float *X, float *H, float *Z)
{
    int V = t->V, i, j, k;
    for (i = 0; i < b; i++)
        for (j = 0; j < CTX; j++)
            memcpy(X + (size_t)i * CTX * EMB + j * EMB, p + (size_t)t->text[pos[i] + j] * EMB, EMB * sizeof(float));
    for (i = 0; i < b; i++) memcpy(H + (size_t)i * HID, p + OFF_B1(V), HID * sizeof(float));
    dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, b, HID, CTX * EMB, 1, X, CTX * EMB, p + OFF_W1(V), HID, 1, H, HID);
    for (k = 0; k < b * HID; k++) H[k] = tanhf(H[k]);
    for (i = 0; i < b; i++) memcpy(Z + (size_t)i * V, p + OFF_B2(V), V * sizeof(float));
    dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, b, V, HID, 1, H, HID, p + OFF_W2(V), V, 1, Z, V);
}

/* Z -> softmax in place; returns the mean cross-entropy against the characters after each context */
static float softmax_loss(const trainer *t, const size_t *pos, int b, float *Z)
{
    double loss = 0;
    int i, k, V = t->V;
    for (i = 0; i < b; i++) {
        float *z = Z + (size_t)i * V, mx = z[0], sum = 0;
        for (k = 1; k < V; k++) mx = z[k] > mx ? z[k] : mx;
        for (k = 0; k < V; k++) sum += (z[k] = expf(z[k] - mx));
        for (k = 0; k < V; k++) z[k] /= sum;
        loss -= log(z[t->text[pos[i] + CTX]] + 1e-30);
    }
    return (float)(loss / b);
}

typedef struct { /* one rank's working memory, allocated once */
    float *p, *g, *m, *v, *X, *H, *Z, *dH, *dX;
    size_t *pos;
} rank_mem;

static dpar_status rank_main(void *user, int rank, int nranks)
{
    trainer *t = (trainer *)user;
    const options *o = &t->o;
    int V = t->V, b = o->batch / nranks, i, j, k;
    size_t np = t->np, q;
    rank_mem w;
    dpar_comm *comm;
    dpar_status st = DPAR_OK;
    char name[32];
    uint64_t tick = 0;
    int64_t step;
    if ((st = dpar_group_join(t->group, rank, &comm)) != DPAR_OK) return st;
    snprintf(name, sizeof name, "rank %d", rank);
    dpar_trace_set_thread_name(name);
    w.p = t->params[rank];
    w.g = (float *)calloc(np + 2, sizeof(float)); /* gradients, then the loss and the stop flag */
    w.m = rank ? (float *)calloc(np, sizeof(float)) : t->adam_m;
    w.v = rank ? (float *)calloc(np, sizeof(float)) : t->adam_v;
    w.X = (float *)malloc(sizeof(float) * b * CTX * EMB);
    w.dX = (float *)malloc(sizeof(float) * b * CTX * EMB);
    w.H = (float *)malloc(sizeof(float) * b * HID);
    w.dH = (float *)malloc(sizeof(float) * b * HID);
    w.Z = (float *)malloc(sizeof(float) * b * V);
    w.pos = (size_t *)malloc(sizeof(size_t) * b);
    if (!w.g || !w.m || !w.v || !w.X || !w.dX || !w.H || !w.dH || !w.Z || !w.pos) {
        st = DPAR_ENOMEM;
        goto out;
    }
    /* the same start everywhere: rank 0's parameters and optimizer state (fresh or resumed) */
    if ((st = dpar_broadcast(comm, w.p, w.p, np, DPAR_F32, 0)) ||
        (st = dpar_broadcast(comm, w.m, w.m, np, DPAR_F32, 0)) ||
        (st = dpar_broadcast(comm, w.v, w.v, np, DPAR_F32, 0)))
        goto out;
    for (step = t->step0; step < o->steps; step++) {
        uint64_t t0 = dpar_time_ns(), t1, t2, t3;
        float loss, lr, *g = w.g, *p = w.p;
        double c1, c2;
        for (i = 0; i < b; i++) { /* sample rank b + i of the step's batch: the same whatever the rank count */
            uint64_t rng = ((uint64_t)o->seed << 32) ^ ((uint64_t)step * 1000003u) ^
                           (uint64_t)(rank * b + i + 1) * 0x5851F42D4C957F2Dull;
            w.pos[i] = (size_t)(splitmix(&rng) % (t->n_train - CTX));
        }
        forward(t, p, w.pos, b, w.X, w.H, w.Z);
        loss = softmax_loss(t, w.pos, b, w.Z);
        t1 = dpar_time_ns();
        /* backward. dZ = (softmax - onehot) / b: the gradient of this rank's mean loss */
        for (i = 0; i < b; i++) w.Z[(size_t)i * V + t->text[w.pos[i] + CTX]] -= 1.0f;
        for (q = 0; q < (size_t)b * V; q++) w.Z[q] /= (float)b;
        memset(g, 0, sizeof(float) * (np + 2));
        dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, HID, V, b, 1, w.H, HID, w.Z, V, 0, g + OFF_W2(V), V); /* dW2 = H^T dZ */
        for (i = 0; i < b; i++)
            for (k = 0; k < V; k++) g[OFF_B2(V) + k] += w.Z[(size_t)i * V + k];
        dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, b, HID, V, 1, w.Z, V, p + OFF_W2(V), V, 0, w.dH, HID); /* dH = dZ W2^T */
        for (q = 0; q < (size_t)b * HID; q++)
            w.H[q] = w.dH[q] * (1.0f - w.H[q] * w.H[q]); /* through tanh: H now holds dA */
        for (i = 0; i < b; i++)
            for (k = 0; k < HID; k++) g[OFF_B1(V) + k] += w.H[(size_t)i * HID + k];
        /* dW1 */
        dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, CTX * EMB, HID, b, 1, w.X, CTX * EMB, w.H, HID, 0, g + OFF_W1(V), HID);
        /* dX */
        dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, b, CTX * EMB, HID, 1, w.H, HID, p + OFF_W1(V), HID, 0, w.dX, CTX * EMB);
        for (i = 0; i < b; i++) /* scatter dX back onto the embedding rows it came from */
            for (j = 0; j < CTX; j++) {
                float *ge = g + (size_t)t->text[w.pos[i] + j] * EMB, *dx = w.dX + (size_t)i * CTX * EMB + j * EMB;
                for (k = 0; k < EMB; k++) ge[k] += dx[k];
            }
        g[np] = loss;
        /* the stop flag rides along with the gradients: every rank sees it after the same step */
        g[np + 1] = rank == 0 && (interrupted || step + 1 == o->stop_at) ? (float)nranks : 0.0f;
        t2 = dpar_time_ns();
        if ((st = dpar_allreduce(comm, g, g, np + 2, DPAR_F32, DPAR_AVG)) != DPAR_OK) goto out;
        t3 = dpar_time_ns();
        /* Adam, the same on every replica (the same averaged gradient): lr decays linearly to 10% */
        lr = o->lr * (1.0f - 0.9f * (float)step / (float)o->steps);
        c1 = 1.0 - pow(0.9, (double)(step + 1));
        c2 = 1.0 - pow(0.999, (double)(step + 1));
        for (q = 0; q < np; q++) {
            w.m[q] = 0.9f * w.m[q] + 0.1f * g[q];
            w.v[q] = 0.999f * w.v[q] + 0.001f * g[q] * g[q];
            p[q] -= lr * (float)(w.m[q] / c1) / (sqrtf((float)(w.v[q] / c2)) + 1e-8f);
        }
        if (dpar_trace_enabled()) {
            uint64_t t4 = dpar_time_ns();
            dpar_trace_event("forward", "train", t0, t1, NULL);
            dpar_trace_event("backward", "train", t1, t2, NULL);
            dpar_trace_event("adam", "train", t3, t4, NULL);
        }
        if (rank == 0) { /* progress, from rank 0 only */
            double now = (double)dpar_time_ns() * 1e-9, el = now - t->t_start;
            int64_t done = step + 1 - t->step0, left = o->steps - step - 1;
            double tps = (double)done * o->batch / (el > 1e-9 ? el : 1e-9);
            if (step == t->step0) t->first_loss = t->last_loss = g[np];
            t->last_loss += (g[np] - t->last_loss) / (done < 50 ? (float)done : 50.0f);
            t->step = step + 1;
            if (t->tty) {
                uint64_t now_tick = (uint64_t)(el * 10);
                if (now_tick != tick || left == 0) {
                    int bar = (int)(30 * (step + 1) / o->steps);
                    double eta = left * el / (double)done;
                    tick = now_tick;
                    printf("\r[%.*s%*s] step %5lld/%d  loss %.3f  %6.0f tok/s  ETA %d:%02d ", bar,
                           "##############################", 30 - bar, "", (long long)(step + 1), o->steps,
                           t->last_loss, tps, (int)eta / 60, (int)eta % 60);
                    fflush(stdout);
                }
            } else if ((step + 1) % (o->steps >= 10 ? o->steps / 10 : 1) == 0 || left == 0) {
                printf("step %5lld/%d  loss %.3f  %.0f tok/s\n", (long long)(step + 1), o->steps, t->last_loss, tps);
                fflush(stdout);
            }
        }
        if (g[np + 1] > 0) { /* someone saw Ctrl-C: every rank leaves after the same step */
            if (rank == 0) t->step = step + 1;
            break;
        }
    }
out:
    if (rank) free(w.m), free(w.v);
    free(w.g), free(w.X), free(w.dX), free(w.H), free(w.dH), free(w.Z), free(w.pos);
    if (st != DPAR_OK) dpar_comm_abort(comm);
    dpar_comm_destroy(comm);
    return st;
}

/* the checkpoint: what the run needs to continue exactly where it stopped. Its header (the model's shape, the
   alphabet, the text's size and CRC) is read first, so that a checkpoint of another text says so before any tensor
   is compared. */
static dpar_status checkpoint(trainer *t, int save)
{
    int64_t shape[4] = {t->V, CTX, EMB, HID};
    int64_t saved_shape[4];
    unsigned char saved_alphabet[256];
    uint64_t saved_text[2];
    dpar_ckpt_item header[3];
    dpar_ckpt_item items[6]; /* replicas: the same on every rank, so they load whatever --threads says */
    dpar_status st;
    items[0] = dpar_ckpt_replica("shape", shape, sizeof shape);
    items[1] = dpar_ckpt_replica("alphabet", t->alphabet, sizeof t->alphabet);
    items[2] = dpar_ckpt_replica("text", t->text_id, sizeof t->text_id);
    items[3] = dpar_ckpt_replica("params", t->params[0], t->np * sizeof(float));
    items[4] = dpar_ckpt_replica("adam", t->adam_m, 2 * t->np * sizeof(float));
    items[5] = dpar_ckpt_replica("step", &t->step, sizeof t->step);
    if (save) return dpar_ckpt_save(NULL, t->o.ckpt, items, 6);

    header[0] = dpar_ckpt_replica("shape", saved_shape, sizeof saved_shape);
    header[1] = dpar_ckpt_replica("alphabet", saved_alphabet, sizeof saved_alphabet);
    header[2] = dpar_ckpt_replica("text", saved_text, sizeof saved_text);
    st = dpar_ckpt_load(NULL, t->o.ckpt, header, 3);
    if (st != DPAR_OK) return st;
    if (saved_shape[0] != t->V || memcmp(saved_alphabet, t->alphabet, sizeof saved_alphabet) != 0)
        return dpar_set_error(DPAR_EINVAL,
                              "the checkpoint '%s' was trained on another text (an alphabet of %lld characters, "
                              "'%s' has %d): resume with the same --data, or start afresh with --overwrite",
                              t->o.ckpt, (long long)saved_shape[0], t->o.data, t->V);
    if (saved_text[0] != t->text_id[0] || saved_text[1] != t->text_id[1])
        return dpar_set_error(
            DPAR_EINVAL,
            "the checkpoint '%s' was trained on another text (%llu bytes, crc32 %08llx; '%s' has "
            "%llu bytes, crc32 %08llx): resume with the same --data, or start afresh with --overwrite",
            t->o.ckpt, (unsigned long long)saved_text[0], (unsigned long long)saved_text[1], t->o.data,
            (unsigned long long)t->text_id[0], (unsigned long long)t->text_id[1]);
    if (saved_shape[1] != CTX || saved_shape[2] != EMB || saved_shape[3] != HID)
        return dpar_set_error(DPAR_EINVAL,
                              "the checkpoint '%s' holds another model (context %lld, embedding %lld, hidden %lld; "
                              "this program: %d, %d, %d)",
                              t->o.ckpt, (long long)saved_shape[1], (long long)saved_shape[2],
                              (long long)saved_shape[3], CTX, EMB, HID);
    return dpar_ckpt_load(NULL, t->o.ckpt, items + 3, 3);
}

/* the mean loss of rank 0's parameters on 256 fixed contexts of the training text: runs that train on the same
   data end with the same figure, whatever their rank count */
static float eval_loss(const trainer *t)
{
    enum { B = 64, ROUNDS = 4 };
    size_t pos[B];
    float *X = (float *)malloc(sizeof(float) * B * CTX * EMB), *H = (float *)malloc(sizeof(float) * B * HID),
          *Z = (float *)malloc(sizeof(float) * B * t->V);
    uint64_t rng = 12345;
    double sum = 0;
    int r, i;
    if (!X || !H || !Z) return free(X), free(H), free(Z), -1.0f;
    for (r = 0; r < ROUNDS; r++) {
        for (i = 0; i < B; i++) pos[i] = (size_t)(splitmix(&rng) % (t->n_train - CTX));
        forward(t, t->params[0], pos, B, X, H, Z);
        sum += softmax_loss(t, pos, B, Z);
    }
    free(X), free(H), free(Z);
    return (float)(sum / ROUNDS);
}

/* The loss on the held-out text (every character of text[n_train, n) predicted from the CTX before it), and the
   same for a reference that needs no training: a table of the training text's bigram counts (add-0.1). What
   sampling produces is what the model does on text it has not seen: a training loss far below the held-out loss
   means the model learned the text by heart (with 16 characters of context, 99% of the training contexts occur
   once and the held-out loss was 2.39, worse than the bigram table's 2.32). */
static void eval_heldout(const trainer *t, double *model, double *bigram)
{
    enum { B = 64 };
    size_t pos[B], p = t->n_train - CTX, n = 0, q;
    float *X = (float *)malloc(sizeof(float) * B * CTX * EMB), *H = (float *)malloc(sizeof(float) * B * HID),
          *Z = (float *)malloc(sizeof(float) * B * t->V);
    double *count = (double *)calloc((size_t)t->V * (t->V + 1), sizeof(double)); /* [a][b] = count of ab; [a][V] */
    int i;
    *model = *bigram = -1;
    if (X && H && Z && count) {
        for (*model = 0; p + CTX < t->n; p += B, n += (size_t)i) {
            for (i = 0; i < B && p + i + CTX < t->n; i++) pos[i] = p + (size_t)i;
            forward(t, t->params[0], pos, i, X, H, Z);
            *model += softmax_loss(t, pos, i, Z) * i;
        }
        *model /= (double)n;
        for (q = 0; q + 1 < t->n_train; q++) count[t->text[q] * (t->V + 1) + t->text[q + 1]]++;
        for (q = 0; q + 1 < t->n_train; q++) count[t->text[q] * (t->V + 1) + t->V]++;
        for (*bigram = 0, q = t->n_train; q < t->n; q++) {
            const double *c = count + t->text[q - 1] * (t->V + 1);
            *bigram -= log((c[t->text[q]] + 0.1) / (c[t->V] + 0.1 * t->V));
        }
        *bigram /= (double)(t->n - t->n_train);
    }
    free(X), free(H), free(Z), free(count);
}

static int letter_at(const trainer *t, size_t q) { return q < t->n_train && isalpha(t->alphabet[t->text[q]]); }

/* the share of the sample's words (runs of letters; the last, maybe cut off, left out) that are words of the
   training text */
static double known_words(const trainer *t, const unsigned char *s, size_t n, int *words)
{
    size_t a = 0, b, q, k, known = 0;
    for (*words = 0;; a = b, ++*words) {
        for (; a < n && !isalpha(s[a]); a++) {}
        for (b = a; b < n && isalpha(s[b]); b++) {}
        if (b >= n) break;
        for (q = 0; q + (b - a) <= t->n_train; q++) { /* the word in the text, with no letter on either side */
            for (k = 0; k < b - a && t->alphabet[t->text[q + k]] == s[a + k]; k++) {}
            if (k == b - a && !(q && letter_at(t, q - 1)) && !letter_at(t, q + k)) break;
        }
        known += q + (b - a) <= t->n_train;
    }
    return *words ? (double)known / *words : 0;
}

/* a control byte (or, in a file that is not text, any byte but newline outside printable ASCII) as \xNN: a sample
   of random bytes must not send escape sequences to the terminal */
static void print_text(const unsigned char *s, size_t n, int binary)
{
    size_t i;
    for (i = 0; i < n; i++) {
        int c = s[i];
        int crlf = c == '\r' && i + 1 < n && s[i + 1] == '\n';
        int printable = c >= 0x20 && c < 0x7f;
        int plain = c == '\n' || printable || (!binary && (c == '\t' || crlf || c >= 0x80));
        if (plain) putchar(c);
        else printf("\\x%02x", c);
    }
    putchar('\n');
}

/* bytes that text does not have: NUL and the control characters other than tab, newline, carriage return and
   form feed */
static size_t odd_bytes(const unsigned char *s, size_t n)
{
    size_t odd = 0, i;
    for (i = 0; i < n; i++) {
        int c = s[i];
        int whitespace = c == '\t' || c == '\n' || c == '\r' || c == '\f';
        if ((c < 0x20 && !whitespace) || c == 0x7f) odd++;
    }
    return odd;
}

static void sample(const trainer *t, int count, float temperature)
{
    size_t pos = 0, i;
    float X[CTX * EMB], H[HID], Z[256];
    unsigned char *ctx = (unsigned char *)malloc(CTX + (size_t)count + 1);
    trainer one = *t;
    uint64_t rng = (uint64_t)t->o.seed;
    int k;
    if (!ctx) return;
    memcpy(ctx, t->text, CTX); /* the prompt: the text's first CTX characters */
    one.text = ctx;
    for (i = 0; i < (size_t)count; i++, pos++) {
        float r, acc = 0;
        forward(&one, t->params[0], &pos, 1, X, H, Z);
        for (k = 0; k < t->V; k++) Z[k] /= temperature;
        ctx[CTX + i] = 0; /* softmax_loss reads a target; any will do */
        softmax_loss(&one, &pos, 1, Z);
        r = uniform(&rng);
        for (k = 0; k < t->V - 1 && (acc += Z[k]) < r; k++) {}
        ctx[CTX + i] = (unsigned char)k;
    }
    for (i = 0; i < CTX + (size_t)count; i++) ctx[i] = t->alphabet[ctx[i]];
    print_text(ctx, CTX + (size_t)count, t->binary);
    {
        int words;
        double share = known_words(t, ctx + CTX, (size_t)count, &words);
        printf("sample: %.0f%% of its %d words are words of the training text\n", 100 * share, words);
    }
    free(ctx);
}

static const char *usage =
    "usage: char_lm [options]\n"
    "Trains a character-level language model data-parallel over thread ranks, then samples from it.\n"
    "  --data FILE     text to learn (default data/fables.txt)\n"
    "  --steps N       train until step N (default 1500)\n"
    "  --threads N     ranks, one thread each (default 2); the batch is split among them\n"
    "  --batch N       global batch: contexts per step over all ranks (default 256)\n"
    "  --lr X          Adam learning rate, decayed linearly to 10% (default 0.004)\n"
    "  --seed N        initial weights, batches and sampling (default 1)\n"
    "  --ckpt PATH     checkpoint written at the end and on Ctrl-C (default: the program's path + .ckpt,\n"
    "                  build/char_lm.ckpt for build/char_lm, the one make demo writes)\n"
    "  --resume        continue from the checkpoint at --ckpt, up to --steps (with any --threads)\n"
    "  --overwrite     start afresh over an existing checkpoint (without it, a fresh run refuses to)\n"
    "  --stop-at N     stop at step N as Ctrl-C would (save the checkpoint; --resume continues)\n"
    "  --sample N      characters to generate at the end (default 400; 0: none)\n"
    "  --temp X        sampling temperature: lower is safer, higher more varied (default 0.5)\n"
    "  --trace FILE    write a Chrome trace (open in chrome://tracing or ui.perfetto.dev)\n"
    "  --help          this text\n"
    "Ctrl-C stops after the current step and saves the checkpoint; --resume continues exactly.\n";

static const char *usage_data = "data/fables.txt";

/* the checkpoint's default path: the program's own path + ".ckpt" (build/char_lm.ckpt for build/char_lm, which is
   what make demo writes), so that a plain `build/char_lm --resume` finds it; "char_lm.ckpt" for a program found
   through PATH */
static const char *default_ckpt(const char *argv0)
{
    static char path[4096];
    if (!argv0 || !strchr(argv0, '/') || strlen(argv0) + 6 > sizeof path) return "char_lm.ckpt";
    snprintf(path, sizeof path, "%s.ckpt", argv0);
    return path;
}

static int fail(const char *msg, const char *arg)
{
    fprintf(stderr, "char_lm: %s%s%s (--help lists the options)\n", msg, arg ? ": " : "", arg ? arg : "");
    return 2;
}

static int int_arg(const char *s, int lo, int hi, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (*s == 0 || *end || v < lo || v > hi) return 0;
    *out = (int)v;
    return 1;
}

int main(int argc, char **argv)
{
    static trainer t;
    options *o = &t.o;
    int i, map[256], quick = getenv("DPAR_TEST_QUICK") != NULL;
    long size;
    struct stat sb;
    FILE *f;
    dpar_pool *pool;
    dpar_pool_desc pd = {0};
    dpar_comm_desc cd = {0};
    dpar_status st;
    double secs;
    o->data = usage_data, o->ckpt = default_ckpt(argv[0]), o->steps = quick ? 60 : 1500, o->threads = 2;
    o->batch = 256, o->lr = 0.004f, o->seed = 1, o->sample = quick ? 80 : 400, o->temp = 0.5f;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes = strcmp(a, "--help") && strcmp(a, "-h") && strcmp(a, "--resume") && strcmp(a, "--overwrite");
        if (strncmp(a, "--", 2) || !strstr(" --help --resume --overwrite --data --ckpt --trace --steps --stop-at "
                                           "--threads --batch --seed --sample --lr --temp ",
                                           a))
            if (strcmp(a, "-h")) return fail("unknown option", a);
        if (takes && !v) return fail("missing value after", a);
        if (!takes) {
            if (strcmp(a, "--resume") == 0) o->resume = 1;
            else if (strcmp(a, "--overwrite") == 0) o->overwrite = 1;
            else return printf("%s", usage), 0;
            continue;
        }
        i++;
        if (strcmp(a, "--data") == 0) o->data = v;
        else if (strcmp(a, "--ckpt") == 0) o->ckpt = v;
        else if (strcmp(a, "--trace") == 0) o->trace = v;
        else if (strcmp(a, "--steps") == 0) {
            if (!int_arg(v, 1, 100000000, &o->steps)) return fail("--steps wants 1 or more, not", v);
        } else if (strcmp(a, "--stop-at") == 0) {
            if (!int_arg(v, 1, 100000000, &o->stop_at)) return fail("--stop-at wants 1 or more, not", v);
        } else if (strcmp(a, "--threads") == 0) {
            if (!int_arg(v, 1, MAXR, &o->threads)) return fail("--threads wants 1 to 64, not", v);
        } else if (strcmp(a, "--batch") == 0) {
            if (!int_arg(v, 1, 1 << 20, &o->batch)) return fail("--batch wants 1 or more, not", v);
        } else if (strcmp(a, "--seed") == 0) {
            if (!int_arg(v, 0, 2147483647, &o->seed)) return fail("--seed wants 0 or more, not", v);
        } else if (strcmp(a, "--sample") == 0) {
            if (!int_arg(v, 0, 1 << 20, &o->sample)) return fail("--sample wants 0 or more, not", v);
        } else if (strcmp(a, "--lr") == 0) {
            char *end;
            o->lr = strtof(v, &end);
            if (*v == 0 || *end || !(o->lr > 0 && o->lr < 10)) return fail("--lr wants a number in (0, 10), not", v);
        } else if (strcmp(a, "--temp") == 0) {
            char *end;
            o->temp = strtof(v, &end);
            if (*v == 0 || *end || !(o->temp >= 0.01f && o->temp <= 10)) return fail("--temp wants 0.01 to 10, not", v);
        } else return fail("unknown option", a);
    }
    if (o->batch % o->threads) return fail("--batch must be a multiple of --threads", NULL);
    if (o->resume && o->overwrite)
        return fail("--resume continues a checkpoint, --overwrite replaces it: give one", NULL);
    { /* find out now, not after training, that the checkpoint cannot be written or would replace another run's */
        int flags = o->resume ? DPAR_CKPT_RESUME : o->overwrite ? DPAR_CKPT_OVERWRITE : 0;
        st = dpar_ckpt_check(o->ckpt, flags);
        if (st == DPAR_EEXIST)
            return fprintf(stderr,
                           "char_lm: %s (--resume continues it, --overwrite replaces it, --ckpt PATH writes "
                           "elsewhere)\n",
                           dpar_last_error()),
                   1;
        if (st != DPAR_OK) return fprintf(stderr, "char_lm: --ckpt: %s\n", dpar_last_error()), 1;
    }

    /* the text, as indices into its sorted alphabet */
    errno = 0;
    if (!(f = fopen(o->data, "rb")) || fstat(fileno(f), &sb) || (!S_ISREG(sb.st_mode) && (errno = EINVAL)) ||
        fseek(f, 0, SEEK_END) || (size = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) ||
        !(t.text = (unsigned char *)malloc((size_t)size + 1)) || fread(t.text, 1, (size_t)size, f) != (size_t)size) {
        fprintf(stderr, "char_lm: cannot read '%s': %s%s\n", o->data,
                errno == EINVAL ? "not a regular file"
                : errno         ? strerror(errno)
                                : "read error",
                o->data == usage_data ? " (run from the repository's root, or give --data FILE)" : "");
        return 1;
    }
    fclose(f);
    t.n = t.n_train = (size_t)size;
    t.text_id[0] = (uint64_t)size;
    t.text_id[1] = dpar_crc32(0, t.text, (size_t)size);
    {
        size_t odd = odd_bytes(t.text, t.n);
        t.binary = odd * 100 > t.n; /* more than 1%: not text */
        if (t.binary)
            fprintf(stderr,
                    "char_lm: warning: '%s' does not look like text (%zu of its %zu bytes are NUL or control bytes); "
                    "training on it anyway, the sample shows such bytes as \\xNN\n",
                    o->data, odd, t.n);
    }
    if (t.n < CTX + 2)
        return fprintf(stderr, "char_lm: '%s' has %zu bytes; it needs at least %d\n", o->data, t.n, CTX + 2), 1;
    memset(map, -1, sizeof map);
    for (size_t q = 0; q < t.n; q++) map[t.text[q]] = 0;
    for (i = 0; i < 256; i++)
        if (map[i] == 0) t.alphabet[map[i] = t.V++] = (unsigned char)i;
    for (size_t q = 0; q < t.n; q++) t.text[q] = (unsigned char)map[t.text[q]];
    if (t.n / 10 > CTX) t.n_train = t.n - t.n / 10; /* the last 10% is held out, if the text is long enough */

    /* rank 0's replica: fresh (small random weights) or from the checkpoint; the others get it by broadcast */
    t.np = NPARAMS(t.V);
    for (i = 0; i < o->threads; i++)
        if (!(t.params[i] = (float *)calloc(t.np, sizeof(float))))
            return fprintf(stderr, "char_lm: out of memory\n"), 1;
    if (!(t.adam_m = (float *)calloc(2 * t.np, sizeof(float)))) return fprintf(stderr, "char_lm: out of memory\n"), 1;
    t.adam_v = t.adam_m + t.np;
    if (o->resume) {
        if (checkpoint(&t, 0) != DPAR_OK) return fprintf(stderr, "char_lm: --resume: %s\n", dpar_last_error()), 1;
        t.step0 = t.step;
    } else {
        uint64_t rng = (uint64_t)o->seed;
        float s1 = 1.0f / sqrtf(CTX * EMB), s2 = 1.0f / sqrtf(HID);
        for (size_t q = 0; q < t.np; q++) {
            float u = 2 * uniform(&rng) - 1;
            t.params[0][q] = q < OFF_W1(t.V)                       ? u
                             : q < OFF_B1(t.V)                     ? u * s1
                             : q >= OFF_W2(t.V) && q < OFF_B2(t.V) ? u * s2
                                                                   : 0;
        }
    }
    printf("char_lm: %zu characters of '%s', alphabet of %d; %zu parameters; %d thread ranks x %d contexts per step\n",
           t.n, o->data, t.V, t.np, o->threads, o->batch / o->threads);
    if (t.step0 >= o->steps)
        printf("the checkpoint is at step %lld already: nothing to train (raise --steps)\n", (long long)t.step0);

    pd.num_threads = o->threads;
    cd.size = o->threads;
    cd.name = "dp";
    if ((st = dpar_pool_create(&pd, &pool)) != DPAR_OK || (st = dpar_group_create(&cd, &t.group)) != DPAR_OK)
        return fprintf(stderr, "char_lm: %s\n", dpar_last_error()), 1;
    if (o->trace && dpar_trace_start(o->trace) != DPAR_OK)
        return fprintf(stderr, "char_lm: --trace: %s\n", dpar_last_error()), 1;
    signal(SIGINT, on_sigint);
    t.tty = isatty(1);
    t.step = t.step0;
    t.t_start = (double)dpar_time_ns() * 1e-9;
    st = t.step0 < o->steps ? dpar_pool_run(pool, rank_main, &t) : DPAR_OK;
    secs = (double)dpar_time_ns() * 1e-9 - t.t_start;
    signal(SIGINT, SIG_DFL);
    if (t.tty && t.step > t.step0) printf("\n");
    if (o->trace) dpar_trace_stop();
    dpar_group_destroy(t.group);
    dpar_pool_destroy(pool);
    if (st != DPAR_OK) return fprintf(stderr, "char_lm: training failed: %s\n", dpar_last_error()), 1;
    /* data parallelism's promise: every replica holds the same weights */
    for (i = 1; i < o->threads && t.step > t.step0; i++)
        if (memcmp(t.params[i], t.params[0], t.np * sizeof(float)))
            return fprintf(stderr, "char_lm: replica %d differs from replica 0\n", i), 1;
    if (t.step > t.step0) {
        if (checkpoint(&t, 1) != DPAR_OK) return fprintf(stderr, "char_lm: %s\n", dpar_last_error()), 1;
        printf("trained steps %lld..%lld in %.1f s (%.0f tokens/s): loss %.3f (first step) -> %.3f (last 50); "
               "checkpoint %s\n",
               (long long)t.step0 + 1, (long long)t.step, secs, (double)(t.step - t.step0) * o->batch / secs,
               t.first_loss, t.last_loss, o->ckpt);
        printf("the %d replicas are identical: parameters crc32 %08x\n", o->threads,
               dpar_crc32(0, t.params[0], t.np * sizeof(float)));
        printf("eval loss %.5f on 256 fixed contexts of the training text after step %lld\n", eval_loss(&t),
               (long long)t.step);
        if (t.n_train < t.n) {
            double model, bigram;
            eval_heldout(&t, &model, &bigram);
            printf("held-out loss %.3f nats/char on the text's last %zu characters, never trained on (a table of the "
                   "training text's bigrams: %.3f)\n",
                   model, t.n - t.n_train, bigram);
        }
    }
    if (interrupted) return printf("interrupted at step %lld: continue with --resume\n", (long long)t.step), 130;
    if (t.step < o->steps && t.step == o->stop_at)
        printf("stopped at step %lld (--stop-at): continue with --resume\n", (long long)t.step);
    if (o->sample) {
        printf("sample (temperature %g, after the text's first %d characters):\n", o->temp, CTX);
        sample(&t, o->sample, o->temp);
    }
    for (i = 0; i < o->threads; i++) free(t.params[i]);
    free(t.adam_m), free(t.text);
    return 0;
}
