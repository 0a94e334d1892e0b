/*
 * Drives Apache Flink's own DSTL (flink-dstl-dfs: FsStateChangelogStorage, its writer and its reader)
 * on the workload of dstl's benchmarks, for bench/flink/run.py. Written for this project; it only
 * calls Flink's public factory and interfaces, with Flink's default options.
 *
 * A long-lived JVM (so the JIT is warm for every round after the first) that reads one command per
 * line on stdin and answers with one JSON line on stdout:
 *   write   append N changes one at a time with writer.append(kg, byte[]), persist(initial sqn), wait
 *           for the handle; the previous round's files are deleted first (outside the timing)
 *   read    iterate every StateChange of the last handle through Flink's StateChangelogHandleReader
 *   quit    close everything and exit
 *
 * Usage: java -cp flink-dist.jar:... FlinkDstlBench BASE_DIR CHANGES VALUE_BYTES KEY_GROUPS SEED
 */

import org.apache.flink.api.common.JobID;
import org.apache.flink.api.common.operators.MailboxExecutor;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.changelog.fs.FsStateChangelogOptions;
import org.apache.flink.changelog.fs.FsStateChangelogStorageFactory;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.runtime.metrics.groups.UnregisteredMetricGroups;
import org.apache.flink.runtime.state.KeyGroupRange;
import org.apache.flink.runtime.state.LocalRecoveryConfig;
import org.apache.flink.runtime.state.SnapshotResult;
import org.apache.flink.runtime.state.StreamStateHandle;
import org.apache.flink.runtime.state.changelog.ChangelogStateHandleStreamImpl;
import org.apache.flink.runtime.state.changelog.StateChange;
import org.apache.flink.runtime.state.changelog.StateChangelogHandleReader;
import org.apache.flink.runtime.state.changelog.StateChangelogStorage;
import org.apache.flink.runtime.state.changelog.StateChangelogStorageView;
import org.apache.flink.runtime.state.changelog.StateChangelogWriter;
import org.apache.flink.util.CloseableIterator;
import org.apache.flink.util.function.ThrowingRunnable;

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.IdentityHashMap;
import java.util.Random;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;

public final class FlinkDstlBench {

    /**
     * The task thread's mailbox, reduced to what the writer needs: upload completions are posted
     * here by Flink's uploader threads and run on the benchmark thread (the writer is not thread
     * safe), between appends and while waiting for a persist, as a Flink task would run them.
     */
    static final class Mailbox implements MailboxExecutor {
        private final LinkedBlockingQueue<ThrowingRunnable<? extends Exception>> mails =
                new LinkedBlockingQueue<>();

        @Override
        public void execute(MailOptions options, ThrowingRunnable<? extends Exception> command,
                            String description, Object... args) {
            mails.add(command);
        }

        /** Runs every mail already posted; returns without waiting. */
        void runPending() throws Exception {
            ThrowingRunnable<? extends Exception> mail;
            while ((mail = mails.poll()) != null) {
                mail.run();
            }
        }

        /** Runs mails until `future` is done (its completion is itself a mail). */
        void runUntil(CompletableFuture<?> future) throws Exception {
            while (!future.isDone()) {
                ThrowingRunnable<? extends Exception> mail = mails.poll(1, TimeUnit.MILLISECONDS);
                if (mail != null) {
                    mail.run();
                }
            }
        }

        @Override
        public void yield() throws InterruptedException {
            try {
                mails.take().run();
            } catch (InterruptedException e) {
                throw e;
            } catch (Exception e) {
                throw new RuntimeException(e);
            }
        }

        @Override
        public boolean tryYield() {
            ThrowingRunnable<? extends Exception> mail = mails.poll();
            if (mail == null) {
                return false;
            }
            try {
                mail.run();
            } catch (Exception e) {
                throw new RuntimeException(e);
            }
            return true;
        }

        @Override
        public boolean shouldInterrupt() {
            return !mails.isEmpty();
        }
    }

    // How often the append loop looks at the mailbox (a task checks it between records).
    private static final int MAILBOX_EVERY = 1024;

    private final int keyGroups;
    private final int[] kgs;
    private final byte[][] values;
    private final Mailbox mailbox = new Mailbox();
    private final StateChangelogStorage<?> storage;
    private final StateChangelogStorageView<?> view;
    private ChangelogStateHandleStreamImpl lastHandle;
    private int round;

    FlinkDstlBench(String baseDir, int changes, int valueBytes, int keyGroups, long seed) throws Exception {
        this.keyGroups = keyGroups;
        // The same layout as the Python side: change i goes to key group i % keyGroups, random bytes.
        Random rng = new Random(seed);
        kgs = new int[changes];
        values = new byte[changes][];
        for (int i = 0; i < changes; i++) {
            kgs[i] = i % keyGroups;
            values[i] = new byte[valueBytes];
            rng.nextBytes(values[i]);
        }
        // Flink's defaults for every option but the base path.
        Configuration config = new Configuration();
        config.set(FsStateChangelogOptions.BASE_PATH, baseDir);
        FsStateChangelogStorageFactory factory = new FsStateChangelogStorageFactory();
        storage = factory.createStorage(new JobID(), config,
                UnregisteredMetricGroups.createUnregisteredTaskManagerJobMetricGroup(),
                LocalRecoveryConfig.BACKUP_AND_RECOVERY_DISABLED);
        view = factory.createStorageView(config);
    }

    @SuppressWarnings({"unchecked", "rawtypes"})
    String write() throws Exception {
        discardLast();
        round++;
        StateChangelogWriter writer = storage.createWriter(
                "bench-" + round, KeyGroupRange.of(0, keyGroups - 1), mailbox);
        int n = kgs.length;
        long t0 = System.nanoTime();
        for (int i = 0; i < n; i++) {
            writer.append(kgs[i], values[i]);
            if ((i & (MAILBOX_EVERY - 1)) == 0) {
                mailbox.runPending();
            }
        }
        CompletableFuture<SnapshotResult<ChangelogStateHandleStreamImpl>> done =
                writer.persist(writer.initialSequenceNumber(), round);
        mailbox.runUntil(done);
        ChangelogStateHandleStreamImpl handle = done.get().getJobManagerOwnedSnapshot();
        double seconds = (System.nanoTime() - t0) / 1e9;
        writer.close();
        lastHandle = handle;
        IdentityHashMap<StreamStateHandle, Boolean> files = new IdentityHashMap<>();
        long fileBytes = 0;
        for (Tuple2<StreamStateHandle, Long> entry : handle.getHandlesAndOffsets()) {
            if (files.put(entry.f0, Boolean.TRUE) == null) {
                fileBytes += entry.f0.getStateSize();
            }
        }
        return String.format("{\"op\":\"write\",\"seconds\":%.6f,\"changes\":%d,\"change_sets\":%d,"
                        + "\"files\":%d,\"file_bytes\":%d}",
                seconds, n, handle.getHandlesAndOffsets().size(), files.size(), fileBytes);
    }

    @SuppressWarnings({"unchecked", "rawtypes"})
    String read() throws Exception {
        if (lastHandle == null) {
            throw new IllegalStateException("read before any write");
        }
        StateChangelogHandleReader reader = view.createReader();
        long count = 0;
        long bytes = 0;
        long t0 = System.nanoTime();
        try (CloseableIterator<StateChange> changes = reader.getChanges(lastHandle)) {
            while (changes.hasNext()) {
                StateChange change = changes.next();
                count++;
                bytes += change.getChange().length;
            }
        }
        double seconds = (System.nanoTime() - t0) / 1e9;
        return String.format("{\"op\":\"read\",\"seconds\":%.6f,\"changes\":%d,\"bytes\":%d}",
                seconds, count, bytes);
    }

    private void discardLast() throws Exception {
        if (lastHandle != null) {
            // The handle itself leaves its files to the shared state registry: delete them here.
            IdentityHashMap<StreamStateHandle, Boolean> files = new IdentityHashMap<>();
            for (Tuple2<StreamStateHandle, Long> entry : lastHandle.getHandlesAndOffsets()) {
                if (files.put(entry.f0, Boolean.TRUE) == null) {
                    entry.f0.discardState();
                }
            }
            lastHandle = null;
        }
    }

    void close() throws Exception {
        discardLast();
        view.close();
        storage.close();
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 5) {
            System.err.println("usage: FlinkDstlBench BASE_DIR CHANGES VALUE_BYTES KEY_GROUPS SEED");
            System.exit(2);
        }
        FlinkDstlBench bench = new FlinkDstlBench(args[0], Integer.parseInt(args[1]),
                Integer.parseInt(args[2]), Integer.parseInt(args[3]), Long.parseLong(args[4]));
        System.out.println("{\"op\":\"ready\",\"java\":\"" + System.getProperty("java.version") + "\"}");
        System.out.flush();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            String command = line.trim();
            String answer;
            if (command.equals("write")) {
                answer = bench.write();
            } else if (command.equals("read")) {
                answer = bench.read();
            } else if (command.equals("quit")) {
                break;
            } else {
                answer = "{\"op\":\"error\",\"message\":\"unknown command\"}";
            }
            System.out.println(answer);
            System.out.flush();
        }
        bench.close();
        System.out.println("{\"op\":\"bye\"}");
        System.out.flush();
        System.exit(0);
    }
}
