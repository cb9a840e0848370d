package upkeep

import "time"

// SetTimer replaces the timer the pause between batches waits on, so a test decides when a pause
// ends instead of sleeping.
func SetTimer(u *Upkeep, newTimer func(d time.Duration) (<-chan time.Time, func() bool)) {
	u.newTimer = newTimer
}
