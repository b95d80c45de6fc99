// The etcd lock Go programs take: go.etcd.io/etcd's concurrency.Mutex (the
// protocol `etcdctl lock` speaks), measured like tower-lock's bench program,
// with the workloads, critical section and output format of
// bench/peers/peer_harness.py.
//
//	go run . --backend etcd://127.0.0.1:2379 --workload uncontended --n 2000
//	go run . --backend etcd://127.0.0.1:2379 --workload contended --secs 5 --workers 8
//
// One client; one session (lease) per worker, as separate Go clients would
// have; the uncontended loop locks and unlocks one Mutex on one session.
//
// `--section-log FILE`: one of several processes on the key, run by
// bench/peers/processes.py (see peer_harness.py for the log's lines).
package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/clientv3"
	"go.etcd.io/etcd/clientv3/concurrency"
)

const warmUp = 500 * time.Millisecond

func pct(sorted []time.Duration, p float64) time.Duration {
	i := int(math.Ceil(float64(len(sorted))*p)) - 1
	if i < 0 {
		i = 0
	}
	if i >= len(sorted) {
		i = len(sorted) - 1
	}
	return sorted[i]
}

func us(d time.Duration) string {
	v := float64(d.Nanoseconds()) / 1e3
	if v < 10 {
		return fmt.Sprintf("%.2f", v)
	}
	return fmt.Sprintf("%.0f", v)
}

func sortDurations(d []time.Duration) {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "etcd_go:", err)
		os.Exit(2)
	}
}

func main() {
	backend := flag.String("backend", "", "etcd://host:port[,host:port...]")
	workload := flag.String("workload", "", "uncontended or contended")
	n := flag.Int("n", 2000, "uncontended cycles")
	secs := flag.Int("secs", 5, "contended seconds")
	workers := flag.Int("workers", 8, "contended workers")
	holdUs := flag.Int("hold-us", 0, "time inside the critical section")
	noLock := flag.Bool("no-lock", false, "the negative control")
	sectionLog := flag.String("section-log", "", "one of several processes: see processes.py")
	flag.Parse()
	if (*noLock || *sectionLog != "") && *workload != "contended" {
		fmt.Fprintln(os.Stderr, "etcd_go: --no-lock and --section-log apply to the contended workload")
		os.Exit(2)
	}
	var log *os.File
	if *sectionLog != "" {
		var err error
		log, err = os.OpenFile(*sectionLog, os.O_WRONLY|os.O_APPEND, 0)
		must(err)
	}
	if !strings.HasPrefix(*backend, "etcd://") || (*workload != "uncontended" && *workload != "contended") {
		fmt.Fprintln(os.Stderr, "usage: etcd_go --backend etcd://host:port --workload uncontended|contended [--n N] [--secs S] [--workers W] [--hold-us U] [--no-lock]")
		os.Exit(2)
	}
	hosts := strings.Split(strings.SplitN(strings.TrimPrefix(*backend, "etcd://"), "/", 2)[0], ",")
	client, err := clientv3.New(clientv3.Config{Endpoints: hosts, DialTimeout: 5 * time.Second})
	must(err)
	defer client.Close()
	ctx := context.Background()
	var line string
	if *workload == "uncontended" {
		session, err := concurrency.NewSession(client, concurrency.WithTTL(10))
		must(err)
		defer session.Close()
		mutex := concurrency.NewMutex(session, fmt.Sprintf("/bench-go/uncontended-%d", os.Getpid()))
		cycle := func() {
			must(mutex.Lock(ctx))
			must(mutex.Unlock(ctx))
		}
		for i := 0; i < 50; i++ {
			cycle()
		}
		samples := make([]time.Duration, 0, *n)
		for i := 0; i < *n; i++ {
			t := time.Now()
			cycle()
			samples = append(samples, time.Since(t))
		}
		sortDurations(samples)
		line = fmt.Sprintf("n=%d p50_us=%s p99_us=%s", *n, us(pct(samples, 0.5)), us(pct(samples, 0.99)))
	} else {
		line = contended(ctx, client, *workers, *secs, time.Duration(*holdUs)*time.Microsecond, !*noLock, log)
	}
	impl := "go-concurrency-mutex"
	if *noLock {
		impl = "no-lock-" + impl
	}
	servers := ""
	if len(hosts) > 1 {
		servers = fmt.Sprintf(" servers=%d", len(hosts))
	}
	fmt.Printf("impl=%s backend=etcd workload=%s%s %s\n", impl, *workload, servers, line)
}

// logSection appends `what pid unix_ns` to the section log, in one write.
func logSection(log *os.File, what string) {
	if log != nil {
		_, err := fmt.Fprintf(log, "%s %d %d\n", what, os.Getpid(), time.Now().UnixNano())
		must(err)
	}
}

func contended(ctx context.Context, client *clientv3.Client, workers, secs int, hold time.Duration, useLock bool, log *os.File) string {
	var stop, counting atomic.Bool
	var inside, overlaps atomic.Int64
	// A key of this process's own, so that an earlier run's session cannot
	// hold it; the processes of a group share one.
	name := fmt.Sprintf("/bench-go/contended-%d", os.Getpid())
	if log != nil {
		name = "/bench-go/contended-group"
	}
	type result struct {
		cycles int
		waits  []time.Duration
	}
	results := make([]result, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		session, err := concurrency.NewSession(client, concurrency.WithTTL(10))
		must(err)
		defer session.Close()
		mutex := concurrency.NewMutex(session, name)
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for !stop.Load() {
				counted := counting.Load()
				t := time.Now()
				if useLock {
					must(mutex.Lock(ctx))
				}
				waited := time.Since(t)
				logSection(log, "E")
				if inside.Add(1) > 1 {
					overlaps.Add(1)
				}
				if hold > 0 {
					time.Sleep(hold)
				} else {
					// Yield, so that a second holder could run while inside.
					time.Sleep(0)
				}
				inside.Add(-1)
				logSection(log, "L")
				if useLock {
					must(mutex.Unlock(ctx))
				}
				if counted {
					results[w].waits = append(results[w].waits, waited)
					results[w].cycles++
				}
			}
		}(w)
	}
	time.Sleep(warmUp)
	counting.Store(true)
	started := time.Now()
	time.Sleep(time.Duration(secs) * time.Second)
	stop.Store(true)
	wg.Wait()
	elapsed := time.Since(started).Seconds()
	var all []time.Duration
	total, min, max := 0, math.MaxInt, 0
	for _, r := range results {
		all = append(all, r.waits...)
		total += r.cycles
		if r.cycles < min {
			min = r.cycles
		}
		if r.cycles > max {
			max = r.cycles
		}
	}
	sortDurations(all)
	if len(all) == 0 {
		all = []time.Duration{0}
	}
	return fmt.Sprintf("workers=%d secs=%d cycles_per_s=%.0f wait_p50_us=%s wait_p99_us=%s per_worker_min=%d per_worker_max=%d overlaps=%d",
		workers, secs, float64(total)/elapsed, us(pct(all, 0.5)), us(pct(all, 0.99)), min, max, overlaps.Load())
}
