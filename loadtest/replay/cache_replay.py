"""A replay of the `cache` scenario (loadtest/src/suite/cache.rs) as a discrete-event model:
vllm-sim's prefix cache (chained 16-token blocks, LRU) and its one FIFO prefill stream,
the 32 closed-loop clients and their conversations, and the endpoint choice of
quantrouter (old and new rule) and of vllm-router's cache_aware. No wall clock, no noise:
it tells which turns are slow and why, and lets a rule's weights be compared.

    python3 loadtest/replay/cache_replay.py prefix cost4 vllm     # one seed each
    python3 loadtest/replay/cache_replay.py --sweep prefix cost4  # mean of five seeds
    LOAD=max ...   # load as the larger of in-flight and a scrape up to a second old (old)
    LOAD=live ...  # the router's own in-flight count (new, with one router replica)
    --why prefix   # where the slowest turns' time went

Policies: `prefix` (longest cached prefix within the load bound, then least load),
`costW` (least queued uncached blocks + W x the prompt's uncached blocks, within the
bound), `least` (power of two choices), `vllm` (vllm-router cache_aware with its defaults).
"""
import hashlib, heapq, json, os, random, statistics, sys
from collections import OrderedDict

PROMPTS = [json.loads(l)['prompt'] for l in open(os.path.join(os.path.dirname(__file__), '..', '..', 'eval', 'prompt-mix.jsonl'))]
REPLICAS, CLIENTS, TURNS, OTHER = 4, 32, 6, 6
DOC_BYTES, MAX_TOKENS = 2000, 16
TTFT, ITL, PREFILL_US = 5e-3, 4e-3, 60e-6
CACHE_BLOCKS, BLOCK_BYTES = 2048, 64
WARMUP, DURATION = 3.0, 10.0
SCRAPE = os.environ.get('SCRAPE', '1') == '1'
LOAD = os.environ.get('LOAD', 'max')

RULES = ("Answer in the customer's language, cite the policy section you rely on, never promise a refund the policy does not cover, escalate legal threats, and keep answers under one hundred words. ")
SYSTEMS = [f"You are assistant {i} of the help desk of retailer number {i}. " + RULES*14 for i in range(OTHER+1)]

def blocks_of(text):
    b = text.encode()
    out, parent = [], b''
    for i in range(0, len(b) - len(b) % BLOCK_BYTES, BLOCK_BYTES):
        parent = hashlib.blake2b(parent + b[i:i+BLOCK_BYTES], digest_size=8).digest()
        out.append(parent)
    return out

class Replica:
    def __init__(s):
        s.free_at = 0.0; s.lru = OrderedDict(); s.served = 0; s.hits = 0; s.queries = 0
        s.inflight = 0; s.table = OrderedDict(); s.pending = 0; s.scraped = 0; s.own_at_scrape = 0  # router's view
    def lookup(s, blocks):
        n = 0
        for b in blocks:
            if b in s.lru: n += 1
            else: break
        for b in reversed(blocks[:n]): s.lru.move_to_end(b)
        return n
    def insert(s, blocks):
        for b in reversed(blocks):
            s.lru[b] = 1; s.lru.move_to_end(b)
        while len(s.lru) > CACHE_BLOCKS: s.lru.popitem(last=False)
    def matched(s, blocks):
        n = 0
        for b in blocks:
            if b in s.table: n += 1
            else: break
        return n
    def record(s, blocks, cap=16384):
        for b in reversed(blocks):
            s.table[b] = 1; s.table.move_to_end(b)
        while len(s.table) > cap: s.table.popitem(last=False)

def choose(policy, reps, blocks, tokens, rng, factor=1.5):
    n = len(blocks)
    if LOAD == 'max': loads = [max(r.inflight, r.scraped) for r in reps]
    elif LOAD == 'live': loads = [r.inflight for r in reps]
    else: loads = [r.inflight + max(0, r.scraped - r.own_at_scrape) for r in reps]
    m = [r.matched(blocks) for r in reps]
    least = min(loads)
    bound = max(int(least*factor), least+1)
    within = [i for i in range(len(reps)) if loads[i] <= bound]
    if policy == 'prefix':
        longest = max(m[i] for i in within)
        c = [i for i in within if m[i] == longest]
        bl = min(loads[i] for i in c); c = [i for i in c if loads[i] == bl]
        return rng.choice(c)
    if policy == 'least':
        i, j = rng.sample(range(len(reps)), 2)
        return i if loads[i] <= loads[j] else j
    if policy == 'vllm':
        # match rate over the request; > 0.3: the best-matching worker, else least load
        best = max(m)
        if n and best / max(1, tokens*4/BLOCK_BYTES) > 0.3:
            return rng.choice([i for i in range(len(reps)) if m[i] == best])
        bl = min(loads); return rng.choice([i for i in range(len(reps)) if loads[i] == bl])
    if policy.startswith('cost'):
        # expected wait: queued uncached blocks + this prompt's uncached blocks
        total = tokens * 4 // BLOCK_BYTES
        w = float(policy[4:] or 1)
        cost = {i: reps[i].pending + w * (total - m[i]) for i in within}
        best = min(cost.values())
        c = [i for i in within if cost[i] == best]
        bl = min(loads[i] for i in c); c = [i for i in c if loads[i] == bl]
        return rng.choice(c)
    raise ValueError(policy)

def run(policy, seed=1, factor=1.5):
    rng = random.Random(seed)
    reps = [Replica() for _ in range(REPLICAS)]
    ev = []; seq = [0]
    def push(t, kind, data):
        seq[0] += 1; heapq.heappush(ev, (t, seq[0], kind, data))
    turns = []  # (start, client, turn, hot, ttft, replica, queued_ahead_s, uncached_tokens, moved)
    clients = []
    for c in range(CLIENTS):
        crng = random.Random(0x5eed ^ c)
        clients.append({'rng': crng, 'msgs': None, 'turn': 0, 'home': None})
        push(0.0, 'send', c)
    push(0.5, 'scrape', None)
    end = WARMUP + DURATION
    while ev:
        t, _, kind, data = heapq.heappop(ev)
        if kind == 'send':
            c = clients[data]; crng = c['rng']
            if c['msgs'] is None or c['turn'] >= TURNS:
                hot = crng.random() < 0.5
                sysp = SYSTEMS[0] if hot else SYSTEMS[1 + crng.randrange(OTHER)]
                doc = "Here is the material for this conversation:\n"
                while len(doc) < DOC_BYTES: doc += crng.choice(PROMPTS) + "\n"
                c.update(msgs=[sysp], turn=0, hot=hot, doc=doc, home=None)
            q = (c['doc'] + "\n" + crng.choice(PROMPTS)) if c['turn'] == 0 else crng.choice(PROMPTS)
            c['msgs'].append(q)
            if t >= end: continue
            text = "".join(c['msgs'])
            tokens = max(1, len(text.encode()) // 4)
            blocks = blocks_of(text)
            i = choose(policy, reps, blocks, tokens, rng, factor)
            r = reps[i]
            moved = c['home'] is not None and c['home'] != i
            c['home'] = i
            router_uncached = tokens*4//BLOCK_BYTES - r.matched(blocks)
            r.record(blocks); r.inflight += 1; r.pending += router_uncached
            # sim: lookup at admission, FIFO prefill
            hit = min(r.lookup(blocks) * 16, tokens - 1)
            r.queries += tokens if t >= WARMUP else 0; r.hits += hit if t >= WARMUP else 0
            unc = tokens - hit
            start = max(t, r.free_at); done = start + unc * PREFILL_US; r.free_at = done
            first = done + TTFT + ITL
            push(done, 'prefilled', (i, blocks))
            push(done + TTFT, 'head', (i, router_uncached))
            push(done + TTFT + ITL * MAX_TOKENS, 'end', (data, i))
            if t >= WARMUP:
                r.served += 1
                turns.append(dict(t=t, client=data, turn=c['turn'], hot=c['hot'], ttft=first - t,
                                  rep=i, queued=start - t, unc=unc, moved=moved))
            c['msgs'].append(f"Noted, point {c['turn']}: here is a short answer to that.")
            c['turn'] += 1
        elif kind == 'scrape':
            if SCRAPE:
                for r in reps: r.scraped = r.inflight; r.own_at_scrape = r.inflight
            if t < end: push(t + rng.uniform(0.9, 1.1), 'scrape', None)
        elif kind == 'prefilled':
            reps[data[0]].insert(data[1])
        elif kind == 'head':
            reps[data[0]].pending -= data[1]
        elif kind == 'end':
            c, i = data; reps[i].inflight -= 1
            push(t, 'send', c)
    tt = sorted(x['ttft'] for x in turns)
    q = lambda p: tt[min(len(tt)-1, int(p*len(tt)))]*1e3
    served = [r.served for r in reps]
    hr = sum(r.hits for r in reps) / sum(r.queries for r in reps)
    return dict(policy=policy, turns=len(tt), p50=q(.5), p99=q(.99), hit=hr,
                maxmean=max(served)/(sum(served)/len(served)), served=served), turns

def why(policy):
    s, turns = run(policy)
    turns.sort(key=lambda x: x['ttft'])
    for name, part in [('all', turns), ('slowest 1%', turns[int(.99 * len(turns)):])]:
        k = len(part)
        count = lambda pred: sum(1 for x in part if pred(x))
        print(f"{name}: {k} turns, first turns {count(lambda x: x['turn'] == 0)}, moved "
              f"{count(lambda x: x['moved'])}, hot prompt {count(lambda x: x['hot'])}; mean wait "
              f"behind other prefills {sum(x['queued'] for x in part) / k * 1e3:.0f} ms, own "
              f"prefill {sum(x['unc'] for x in part) / k * PREFILL_US * 1e3:.0f} ms")

def show(s):
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items()}))

if __name__ == '__main__':
    args = sys.argv[1:]
    if args[:1] == ['--why']:
        for p in args[1:]: why(p)
    elif args[:1] == ['--sweep']:
        for p in args[1:]:
            rs = [run(p, seed)[0] for seed in range(1, 6)]
            mean = lambda k: statistics.mean(r[k] for r in rs)
            show(dict(policy=p, turns=mean('turns'), p50=mean('p50'), p99=mean('p99'),
                      hit=mean('hit'), maxmean=mean('maxmean')))
    else:
        for p in args: show(run(p)[0])
