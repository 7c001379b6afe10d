/* The emulated internet's delay line: holds every IPv4 packet routed into a TUN device for the
 * one-way delay of its path, drops a fraction of them if asked, and writes them back.
 *
 *   delay_line TUN SEED RULE...      RULE = a.b.c.d/len,up_us,down_us,loss_up_ppm,loss_down_ppm
 *                                     or   path:a.b.c.d/len>e.f.g.h/len,delay_us,rate_kbit,queue_us
 *
 * A packet from host S to host D is held up_us(S) + down_us(D) and dropped with probability
 * 1 - (1 - loss_up(S)) (1 - loss_down(D)); the first rule whose prefix holds an address is the
 * one used, and an address no rule holds adds nothing. Packets keep their order on a path (a heap
 * on (due time, arrival number)).
 *
 * A path rule is a link between two places beyond the hosts' own (two regions, a continent apart):
 * a packet from S in the first prefix to D in the second is held delay_us more and, with a rate,
 * goes through a serial link of rate_kbit of its own (per rule, one direction): it leaves when the
 * packets before it on that link have, and one that would wait more than queue_us is dropped, as a
 * full router queue drops it. The first path rule that holds (S, D) is the one used. The router namespace sends every packet arriving from a host
 * link into the TUN device and routes what comes back out of it normally (peer/harness/internet.py).
 *
 * Signals: SIGUSR1 prints one JSON line of statistics (and starts counting afresh); SIGTERM or
 * SIGINT prints it and exits. "late" is how long after its due time a packet was written back:
 * the error this line adds to the delay it was asked for.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define MAX_RULES 256
#define SLOT_BYTES 2048          /* the TUN device's MTU is 1500: no packet is larger */
#define MAX_PACKETS 16384        /* held at once; beyond that a packet is dropped, like a full queue */
#define LATE_BUCKETS 10000       /* 10 us each: 0 to 100 ms */

struct rule { uint32_t net, mask; uint64_t up_ns, down_ns; uint32_t loss_up, loss_down; };
struct held { uint64_t due, seq; int slot; int len; };
struct path { uint32_t from_net, from_mask, to_net, to_mask; uint64_t delay_ns, rate_kbit, queue_ns, free_at; };

static struct rule rules[MAX_RULES];
static int num_rules;
static struct path paths[MAX_RULES];
static int num_paths;
static struct held heap[MAX_PACKETS];
static int heap_len;
static unsigned char *slots;
static int free_slots[MAX_PACKETS], num_free;
static uint64_t rng_state;
static volatile sig_atomic_t stop_requested, stats_requested;

static struct {
    uint64_t packets, bytes, dropped_loss, dropped_full, dropped_path, dropped_write, not_ipv4, late_max;
    uint64_t late[LATE_BUCKETS];
} stats;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint32_t next_random(void) {  /* xorshift64* */
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 2685821657736338717ull) >> 32);
}

static const struct rule *rule_for(uint32_t address) {
    for (int i = 0; i < num_rules; i++)
        if ((address & rules[i].mask) == rules[i].net) return &rules[i];
    return NULL;
}

static int earlier(const struct held *a, const struct held *b) {
    return a->due < b->due || (a->due == b->due && a->seq < b->seq);
}

static void heap_push(struct held item) {
    int i = heap_len++;
    while (i > 0) {
        int parent = (i - 1) / 2;
        if (!earlier(&item, &heap[parent])) break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = item;
}

static struct held heap_pop(void) {
    struct held top = heap[0], last = heap[--heap_len];
    int i = 0;
    for (;;) {
        int child = 2 * i + 1;
        if (child >= heap_len) break;
        if (child + 1 < heap_len && earlier(&heap[child + 1], &heap[child])) child++;
        if (!earlier(&heap[child], &last)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (heap_len > 0) heap[i] = last;
    return top;
}

static uint64_t late_percentile(double fraction) {
    uint64_t total = 0, seen = 0;
    for (int i = 0; i < LATE_BUCKETS; i++) total += stats.late[i];
    if (total == 0) return 0;
    for (int i = 0; i < LATE_BUCKETS; i++) {
        seen += stats.late[i];
        if ((double)seen >= fraction * (double)total) return (uint64_t)i * 10 + 10;
    }
    return stats.late_max / 1000;
}

static void print_stats(void) {
    printf("{\"packets\": %llu, \"bytes\": %llu, \"dropped_loss\": %llu, \"dropped_full\": %llu, "
           "\"dropped_path\": %llu, \"dropped_write\": %llu, \"not_ipv4\": %llu, \"held_now\": %d, \"late_p50_us\": %llu, "
           "\"late_p99_us\": %llu, \"late_max_us\": %llu}\n",
           (unsigned long long)stats.packets, (unsigned long long)stats.bytes,
           (unsigned long long)stats.dropped_loss, (unsigned long long)stats.dropped_full,
           (unsigned long long)stats.dropped_path, (unsigned long long)stats.dropped_write, (unsigned long long)stats.not_ipv4, heap_len,
           (unsigned long long)late_percentile(0.5), (unsigned long long)late_percentile(0.99),
           (unsigned long long)(stats.late_max / 1000));
    fflush(stdout);
    memset(&stats, 0, sizeof stats);
}

static void on_signal(int signal_number) {
    if (signal_number == SIGUSR1) stats_requested = 1;
    else stop_requested = 1;
}

static int parse_rule(const char *text, struct rule *rule) {
    char address[64];
    unsigned prefix;
    unsigned long long up_us, down_us;
    unsigned loss_up, loss_down;
    struct in_addr parsed;
    if (sscanf(text, "%63[0-9.]/%u,%llu,%llu,%u,%u", address, &prefix, &up_us, &down_us, &loss_up, &loss_down) != 6
        || prefix > 32 || loss_up > 1000000 || loss_down > 1000000 || inet_pton(AF_INET, address, &parsed) != 1)
        return -1;
    rule->mask = prefix == 0 ? 0 : htonl(0xffffffffu << (32 - prefix));
    rule->net = parsed.s_addr & rule->mask;
    rule->up_ns = up_us * 1000ull;
    rule->down_ns = down_us * 1000ull;
    rule->loss_up = loss_up;
    rule->loss_down = loss_down;
    return 0;
}

static int parse_prefix(const char *address, unsigned prefix, uint32_t *net, uint32_t *mask) {
    struct in_addr parsed;
    if (prefix > 32 || inet_pton(AF_INET, address, &parsed) != 1) return -1;
    *mask = prefix == 0 ? 0 : htonl(0xffffffffu << (32 - prefix));
    *net = parsed.s_addr & *mask;
    return 0;
}

static int parse_path(const char *text, struct path *path) {
    char from[64], to[64];
    unsigned from_len, to_len;
    unsigned long long delay_us, rate_kbit, queue_us;
    if (sscanf(text, "path:%63[0-9.]/%u>%63[0-9.]/%u,%llu,%llu,%llu", from, &from_len, to, &to_len, &delay_us,
               &rate_kbit, &queue_us) != 7
        || parse_prefix(from, from_len, &path->from_net, &path->from_mask) != 0
        || parse_prefix(to, to_len, &path->to_net, &path->to_mask) != 0)
        return -1;
    path->delay_ns = delay_us * 1000ull;
    path->rate_kbit = rate_kbit;
    path->queue_ns = queue_us * 1000ull;
    path->free_at = 0;
    return 0;
}

static struct path *path_for(uint32_t source, uint32_t destination) {
    for (int i = 0; i < num_paths; i++)
        if ((source & paths[i].from_mask) == paths[i].from_net && (destination & paths[i].to_mask) == paths[i].to_net)
            return &paths[i];
    return NULL;
}

static int open_tun(const char *name) {
    struct ifreq request;
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK);
    if (fd < 0) { perror("delay_line: /dev/net/tun"); return -1; }
    memset(&request, 0, sizeof request);
    request.ifr_flags = IFF_TUN | IFF_NO_PI;
    strncpy(request.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &request) < 0) { perror("delay_line: TUNSETIFF"); close(fd); return -1; }
    return fd;
}

/* Take one packet the kernel routed into the device: hold it, drop it, or count it as foreign. */
static void take(const unsigned char *packet, int len, uint64_t now) {
    if (len < 20 || (packet[0] >> 4) != 4) { stats.not_ipv4++; return; }
    uint32_t source, destination;
    memcpy(&source, packet + 12, 4);
    memcpy(&destination, packet + 16, 4);
    const struct rule *from = rule_for(source), *to = rule_for(destination);
    uint64_t delay = (from ? from->up_ns : 0) + (to ? to->down_ns : 0);
    uint64_t keep = (uint64_t)(1000000 - (from ? from->loss_up : 0)) * (1000000 - (to ? to->loss_down : 0));
    if (keep < 1000000000000ull && (uint64_t)(next_random() % 1000000) * 1000000 >= keep) {
        stats.dropped_loss++;
        return;
    }
    if (num_free == 0 || len > SLOT_BYTES) { stats.dropped_full++; return; }
    uint64_t leaves = now;
    struct path *path = path_for(source, destination);
    if (path != NULL) {
        delay += path->delay_ns;
        if (path->rate_kbit > 0) {  /* a serial link: after the packets before it, for its own length */
            leaves = path->free_at > now ? path->free_at : now;
            if (leaves - now > path->queue_ns) { stats.dropped_path++; return; }
            leaves += (uint64_t)len * 8000000ull / path->rate_kbit;
            path->free_at = leaves;
        }
    }
    static uint64_t arrivals;
    int slot = free_slots[--num_free];
    memcpy(slots + (size_t)slot * SLOT_BYTES, packet, (size_t)len);
    heap_push((struct held){.due = leaves + delay, .seq = arrivals++, .slot = slot, .len = len});
}

/* Write back every packet whose time has come. */
static void release(int fd) {
    uint64_t now = now_ns();
    while (heap_len > 0 && heap[0].due <= now) {
        struct held item = heap_pop();
        uint64_t late = now - item.due;
        if (write(fd, slots + (size_t)item.slot * SLOT_BYTES, (size_t)item.len) < 0) stats.dropped_write++;
        else { stats.packets++; stats.bytes += (uint64_t)item.len; }
        stats.late[late / 10000 < LATE_BUCKETS ? late / 10000 : LATE_BUCKETS - 1]++;
        if (late > stats.late_max) stats.late_max = late;
        free_slots[num_free++] = item.slot;
        if ((stats.packets & 63) == 0) now = now_ns();
    }
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: delay_line TUN SEED [a.b.c.d/len,up_us,down_us,loss_up_ppm,loss_down_ppm | "
                        "path:a.b.c.d/len>e.f.g.h/len,delay_us,rate_kbit,queue_us ...]\n");
        return 2;
    }
    for (int i = 3; i < argc; i++) {
        if (strncmp(argv[i], "path:", 5) == 0) {
            if (num_paths == MAX_RULES || parse_path(argv[i], &paths[num_paths]) != 0) {
                fprintf(stderr, "delay_line: bad path '%s' (path:a.b.c.d/len>e.f.g.h/len,delay_us,rate_kbit,queue_us)\n", argv[i]);
                return 2;
            }
            num_paths++;
            continue;
        }
        if (num_rules == MAX_RULES || parse_rule(argv[i], &rules[num_rules]) != 0) {
            fprintf(stderr, "delay_line: bad rule '%s' (a.b.c.d/len,up_us,down_us,loss_up_ppm,loss_down_ppm)\n", argv[i]);
            return 2;
        }
        num_rules++;
    }
    rng_state = strtoull(argv[2], NULL, 10) | 1;
    slots = malloc((size_t)MAX_PACKETS * SLOT_BYTES);
    if (slots == NULL) { fprintf(stderr, "delay_line: out of memory\n"); return 1; }
    for (int i = 0; i < MAX_PACKETS; i++) free_slots[num_free++] = MAX_PACKETS - 1 - i;
    int fd = open_tun(argv[1]);
    if (fd < 0) return 1;
    /* Real-time priority where allowed, so a busy CPU does not stretch the delay it emulates. */
    struct sched_param priority = {.sched_priority = 10};
    int realtime = sched_setscheduler(0, SCHED_FIFO, &priority) == 0;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_signal;
    sigaction(SIGTERM, &action, NULL);
    sigaction(SIGINT, &action, NULL);
    sigaction(SIGUSR1, &action, NULL);
    printf("{\"ready\": true, \"realtime\": %s, \"rules\": %d, \"paths\": %d}\n", realtime ? "true" : "false", num_rules,
           num_paths);
    fflush(stdout);
    static unsigned char buffer[65536];
    struct pollfd wait_for = {.fd = fd, .events = POLLIN};
    while (!stop_requested) {
        if (stats_requested) { stats_requested = 0; print_stats(); }
        release(fd);
        struct timespec timeout = {.tv_sec = 1, .tv_nsec = 0};
        if (heap_len > 0) {
            uint64_t now = now_ns(), due = heap[0].due;
            uint64_t wait = due > now ? due - now : 0;
            timeout.tv_sec = (time_t)(wait / 1000000000ull);
            timeout.tv_nsec = (long)(wait % 1000000000ull);
        }
        if (ppoll(&wait_for, 1, &timeout, NULL) < 0 && errno != EINTR) { perror("delay_line: ppoll"); break; }
        if (!(wait_for.revents & POLLIN)) continue;
        for (int i = 0; i < 256; i++) {  /* a batch, then back to releasing what is due */
            ssize_t len = read(fd, buffer, sizeof buffer);
            if (len < 0) break;
            take(buffer, (int)len, now_ns());
        }
    }
    print_stats();
    return 0;
}
