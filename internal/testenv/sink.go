package testenv

import "github.com/buzzpg/buzzpg/internal/evt"

// Sink is an evt.Sink for tests: Event and Due, when set, receive the events and the due signals
// handed over; member changes and stream restarts are dropped.
type Sink struct {
	Event func(evt.Delivery)
	Due   func(evt.Due)
}

func (s Sink) DeliverEvent(d evt.Delivery) {
	if s.Event != nil {
		s.Event(d)
	}
}

func (s Sink) DeliverDue(d evt.Due) {
	if s.Due != nil {
		s.Due(d)
	}
}

func (Sink) MembersChanged(evt.MembersChange) {}

func (Sink) StreamRestarted() {}
