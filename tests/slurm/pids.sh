# Sourced by cluster_up.sh, multinode_up.sh and the down scripts: how a daemon is started and its
# recorded pid checked. Needs $PIDS (the folder of <name>.pid records), $LOG, log() and die().

MYSQL_SOCK=/run/mysqld/mysqld.sock
MYSQL_DATADIR=/var/lib/mysql

bin_of() {
    case $1 in
    munged | mariadbd | slurmdbd | slurmctld | slurmd) echo "/usr/sbin/$1" ;;
    slurmd-*) echo /usr/sbin/slurmd ;; # one slurmd per host of a multi-node cluster
    *) die "unknown daemon $1" ;;
    esac
}

# pid of our running daemon <name>, or fail. The recorded pid must still run the daemon's binary,
# so a zombie, or a dead daemon's pid reused by another process, is never taken (or signalled).
our_pid() {
    local f=$PIDS/$1.pid pid exe
    [[ -r $f ]] || return 1
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
    [[ ${exe% (deleted)} == "$(readlink -f "$(bin_of "$1")")" ]] || return 1
    echo "$pid"
}
alive() { our_pid "$1" >/dev/null; }

# spawn <name> <command...>: start a daemon in the foreground of its own session, detached from our
# stdio (so `$(cluster_up.sh)` does not wait for it), and record its pid.
spawn() {
    local name=$1 pid i
    shift
    (
        # close inherited descriptors other than 0-2: a daemon holding a caller's pipe would hang it
        fds=(/proc/$BASHPID/fd/*)
        for f in "${fds[@]}"; do
            n=${f##*/}
            if [[ $n =~ ^[0-9]+$ ]] && ((n > 2)) && [[ -e $f ]]; then eval "exec $n>&-"; fi
        done
        exec setsid "$@" </dev/null >>"$LOG/$name.out" 2>&1
    ) &
    pid=$!
    echo "$pid" >"$PIDS/$name.pid"
    for ((i = 0; i < 100; i++)); do # until the subshell has exec'd the daemon
        alive "$name" && { log "started $name (pid $pid)"; return 0; }
        [[ -e /proc/$pid/exe ]] || break
        sleep 0.05
    done
    rm -f "$PIDS/$name.pid"
    tail -n 20 "$LOG/$name.out" >&2 || true
    die "$name did not start (see $LOG/$name.out)"
}

# wait_for <seconds> <description> <command...>
wait_for() {
    local secs=$1 what=$2 end
    shift 2
    end=$(($(date +%s%N) + secs * 1000000000))
    until "$@" >/dev/null 2>&1; do
        (($(date +%s%N) < end)) || return 1
        sleep 0.1
    done
}

mysql_ok() { mariadb-admin --no-defaults --socket="$MYSQL_SOCK" ping; }

# start_mariadb: a MariaDB server on $MYSQL_SOCK (unix socket only, so every network namespace of
# this machine reaches it through the file system): ours if it runs, another one if it answers
# (left alone), else a new one recorded as ours.
start_mariadb() {
    if alive mariadbd; then
        return 0
    elif mysql_ok >/dev/null 2>&1; then
        log "using a MariaDB server this script did not start (it will not stop it)"
        rm -f "$PIDS/mariadbd.pid"
        return 0
    fi
    mkdir -p /run/mysqld
    chown mysql:mysql /run/mysqld
    if [[ ! -d $MYSQL_DATADIR/mysql ]]; then
        log "initialising $MYSQL_DATADIR"
        mkdir -p "$MYSQL_DATADIR"
        chown mysql:mysql "$MYSQL_DATADIR"
        mariadb-install-db --no-defaults --user=mysql --datadir="$MYSQL_DATADIR" \
            --auth-root-authentication-method=socket --skip-test-db >>"$LOG/mariadb-install-db.out" 2>&1 ||
            die "mariadb-install-db failed (see $LOG/mariadb-install-db.out)"
    fi
    rm -f /run/mysqld/mysqld.pid
    spawn mariadbd /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$MYSQL_DATADIR" \
        --socket="$MYSQL_SOCK" --pid-file=/run/mysqld/mysqld.pid --skip-networking \
        --innodb-lock-wait-timeout=900
    wait_for 60 mariadb mysql_ok || die "MariaDB does not answer (see $LOG/mariadbd.out)"
}

# accounting_db <database> <user> <password>: slurmdbd's database and its user, on $MYSQL_SOCK.
accounting_db() {
    mariadb --no-defaults --socket="$MYSQL_SOCK" -uroot >&2 <<SQL
CREATE DATABASE IF NOT EXISTS $1;
CREATE USER IF NOT EXISTS '$2'@'localhost' IDENTIFIED BY '$3';
ALTER USER '$2'@'localhost' IDENTIFIED BY '$3';
GRANT ALL ON $1.* TO '$2'@'localhost';
FLUSH PRIVILEGES;
SQL
}
